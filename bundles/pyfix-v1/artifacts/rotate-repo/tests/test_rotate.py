import unittest

from rotate import rotate


class TestRotate(unittest.TestCase):
    def test_rotate(self):
        self.assertEqual(rotate([1, 2, 3], 1), [3, 1, 2])
        self.assertEqual(rotate([1, 2, 3], 4), [3, 1, 2])
        self.assertEqual(rotate([], 2), [])


if __name__ == "__main__":
    unittest.main()
