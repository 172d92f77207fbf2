import unittest

from bsearch import bsearch


class TestBsearch(unittest.TestCase):
    def test_bsearch(self):
        self.assertEqual(bsearch([1, 3, 5, 7], 7), 3)
        self.assertEqual(bsearch([1, 3, 5], 1), 0)
        self.assertEqual(bsearch([1, 3, 5], 4), -1)
        self.assertEqual(bsearch([2], 2), 0)


if __name__ == "__main__":
    unittest.main()
