import unittest

from digitsum import digit_sum


class TestDigitsum(unittest.TestCase):
    def test_digitsum(self):
        self.assertEqual(digit_sum(-123), 6)
        self.assertEqual(digit_sum(5), 5)


if __name__ == "__main__":
    unittest.main()
