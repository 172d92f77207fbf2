import unittest

from chunk import chunk


class TestChunk(unittest.TestCase):
    def test_chunk(self):
        self.assertEqual(chunk([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]])
        self.assertEqual(chunk([1, 2], 1), [[1], [2]])


if __name__ == "__main__":
    unittest.main()
