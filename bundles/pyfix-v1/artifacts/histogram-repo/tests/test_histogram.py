import unittest

from histogram import histogram


class TestHistogram(unittest.TestCase):
    def test_histogram(self):
        self.assertEqual(histogram('abca'), {'a': 2, 'b': 1, 'c': 1})


if __name__ == "__main__":
    unittest.main()
