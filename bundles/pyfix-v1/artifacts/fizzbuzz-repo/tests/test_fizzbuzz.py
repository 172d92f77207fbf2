import unittest

from fizzbuzz import fizzbuzz


class TestFizzbuzz(unittest.TestCase):
    def test_fizzbuzz(self):
        self.assertEqual(fizzbuzz(15), 'FizzBuzz')
        self.assertEqual(fizzbuzz(9), 'Fizz')
        self.assertEqual(fizzbuzz(10), 'Buzz')
        self.assertEqual(fizzbuzz(7), '7')
        self.assertEqual(fizzbuzz(16), '16')


if __name__ == "__main__":
    unittest.main()
