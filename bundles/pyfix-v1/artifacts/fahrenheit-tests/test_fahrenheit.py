import unittest

from fahrenheit import to_fahrenheit


class TestFahrenheit(unittest.TestCase):
    def test_fahrenheit(self):
        self.assertEqual(to_fahrenheit(100), 212)
        self.assertEqual(to_fahrenheit(0), 32)


if __name__ == "__main__":
    unittest.main()
