import unittest

from reversewords import reverse_words


class TestReversewords(unittest.TestCase):
    def test_reversewords(self):
        self.assertEqual(reverse_words('one two three'), 'three two one')


if __name__ == "__main__":
    unittest.main()
