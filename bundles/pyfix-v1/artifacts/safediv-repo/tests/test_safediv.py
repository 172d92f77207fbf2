import unittest

from safediv import safe_div


class TestSafediv(unittest.TestCase):
    def test_safediv(self):
        self.assertIsNone(safe_div(1, 0))
        self.assertEqual(safe_div(6, 3), 2)


if __name__ == "__main__":
    unittest.main()
