import unittest

from parsekv import parse_kv


class TestParsekv(unittest.TestCase):
    def test_parsekv(self):
        self.assertEqual(parse_kv('a=1; b = 2;'), {'a': '1', 'b': '2'})


if __name__ == "__main__":
    unittest.main()
