import unittest

from isprime import is_prime


class TestIsprime(unittest.TestCase):
    def test_isprime(self):
        self.assertFalse(is_prime(1))
        self.assertFalse(is_prime(9))
        self.assertFalse(is_prime(25))
        self.assertTrue(is_prime(13))


if __name__ == "__main__":
    unittest.main()
