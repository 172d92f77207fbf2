import unittest

from mergedicts import merge


class TestMergedicts(unittest.TestCase):
    def test_mergedicts(self):
        self.assertEqual(merge({'a': 1, 'b': 2}, {'b': 3}), {'a': 1, 'b': 3})


if __name__ == "__main__":
    unittest.main()
