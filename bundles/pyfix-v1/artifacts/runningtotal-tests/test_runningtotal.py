import unittest

from runningtotal import running_total


class TestRunningtotal(unittest.TestCase):
    def test_runningtotal(self):
        self.assertEqual(running_total([1, 2, 3]), [1, 3, 6])


if __name__ == "__main__":
    unittest.main()
