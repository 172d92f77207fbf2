import unittest

from stripcomment import strip_comment


class TestStripcomment(unittest.TestCase):
    def test_stripcomment(self):
        self.assertEqual(strip_comment('x = 1  # one'), 'x = 1')


if __name__ == "__main__":
    unittest.main()
