import unittest

from secondlargest import second_largest


class TestSecondlargest(unittest.TestCase):
    def test_secondlargest(self):
        self.assertEqual(second_largest([5, 1, 5, 3]), 3)


if __name__ == "__main__":
    unittest.main()
