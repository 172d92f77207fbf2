import unittest

from snakecase import snake_case


class TestSnakecase(unittest.TestCase):
    def test_snakecase(self):
        self.assertEqual(snake_case('HelloWorld'), 'hello_world')


if __name__ == "__main__":
    unittest.main()
