import unittest

from palindrome import is_palindrome


class TestPalindrome(unittest.TestCase):
    def test_palindrome(self):
        self.assertTrue(is_palindrome('Never odd or even'))
        self.assertFalse(is_palindrome('abc'))


if __name__ == "__main__":
    unittest.main()
