import unittest

from flatten import flatten


class TestFlatten(unittest.TestCase):
    def test_flatten(self):
        self.assertEqual(flatten([1, [2, [3, [4]]]]), [1, 2, 3, 4])


if __name__ == "__main__":
    unittest.main()
