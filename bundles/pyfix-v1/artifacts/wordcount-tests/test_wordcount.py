import unittest

from wordcount import word_count


class TestWordcount(unittest.TestCase):
    def test_wordcount(self):
        self.assertEqual(word_count('a  b c'), 3)
        self.assertEqual(word_count(''), 0)


if __name__ == "__main__":
    unittest.main()
