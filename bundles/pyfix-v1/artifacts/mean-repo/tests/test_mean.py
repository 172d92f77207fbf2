import unittest

from mean import mean


class TestMean(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3]), 2)
        self.assertEqual(mean([4]), 4)


if __name__ == "__main__":
    unittest.main()
