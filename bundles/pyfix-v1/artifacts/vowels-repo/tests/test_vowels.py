import unittest

from vowels import count_vowels


class TestVowels(unittest.TestCase):
    def test_vowels(self):
        self.assertEqual(count_vowels('Queue Up'), 5)


if __name__ == "__main__":
    unittest.main()
