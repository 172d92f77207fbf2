import unittest

from caesar import caesar


class TestCaesar(unittest.TestCase):
    def test_caesar(self):
        self.assertEqual(caesar('xyz', 3), 'abc')
        self.assertEqual(caesar('a b', 1), 'b c')


if __name__ == "__main__":
    unittest.main()
