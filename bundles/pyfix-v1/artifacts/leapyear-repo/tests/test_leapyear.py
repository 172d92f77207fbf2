import unittest

from leapyear import is_leap


class TestLeapyear(unittest.TestCase):
    def test_leapyear(self):
        self.assertTrue(is_leap(2000))
        self.assertFalse(is_leap(1900))
        self.assertTrue(is_leap(2024))
        self.assertFalse(is_leap(2023))


if __name__ == "__main__":
    unittest.main()
