import unittest

from titlecase import title_case


class TestTitlecase(unittest.TestCase):
    def test_titlecase(self):
        self.assertEqual(title_case('hELLO wORLD'), 'Hello World')


if __name__ == "__main__":
    unittest.main()
