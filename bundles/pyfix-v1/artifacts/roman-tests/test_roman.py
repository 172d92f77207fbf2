import unittest

from roman import roman


class TestRoman(unittest.TestCase):
    def test_roman(self):
        self.assertEqual(roman(4), 'IV')
        self.assertEqual(roman(1994), 'MCMXCIV')


if __name__ == "__main__":
    unittest.main()
