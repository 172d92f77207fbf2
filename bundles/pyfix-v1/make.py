"""make.py: write pyfix-v1's tasks, artifacts, reference fixes and splits from the table below.

Each entry is a short Python module with one bug: its fixed source, the one replacement that puts
the bug in, and the unittest tests the fixed module passes and the buggy one fails. Run it from any
folder (``python bundles/pyfix-v1/make.py``); it rewrites the bundle's generated files and checks
each bug, both ways the tests run: the model's way (``python3 -m unittest discover -s tests``) and
the trusted runner's (``run_tests.py``, which scores), passing on the fix and failing on the bug.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNNER = "pyfix-runner"        # the judge every task shares: artifacts/pyfix-runner/run_tests.py,
JUDGE = HERE / "artifacts" / RUNNER / "run_tests.py"      # written by hand, never by this script
VERIFY_DIR = "/tmp/pyfix-verify"

# name: (fixed source, (the fix's text, the bug's text), tests)
BUGS: dict[str, tuple[str, tuple[str, str], str]] = {
    "clamp": ("def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
              ("min(x, hi)", "min(x, lo)"),
              "self.assertEqual(clamp(5, 0, 10), 5)\nself.assertEqual(clamp(-1, 0, 10), 0)\n"
              "self.assertEqual(clamp(11, 0, 10), 10)"),
    "mean": ("def mean(xs):\n    return sum(xs) / len(xs)\n",
             ("len(xs)", "(len(xs) + 1)"),
             "self.assertEqual(mean([1, 2, 3]), 2)\nself.assertEqual(mean([4]), 4)"),
    "palindrome": ("def is_palindrome(text):\n    kept = [c.lower() for c in text if c.isalnum()]\n"
                   "    return kept == kept[::-1]\n",
                   ("c.lower() for", "c for"),
                   "self.assertTrue(is_palindrome('Never odd or even'))\n"
                   "self.assertFalse(is_palindrome('abc'))"),
    "fizzbuzz": ("def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n"
                 "    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n"
                 "    return str(n)\n",
                 ("n % 15 == 0", "n % 15 == 1"),
                 "self.assertEqual(fizzbuzz(15), 'FizzBuzz')\nself.assertEqual(fizzbuzz(9), 'Fizz')\n"
                 "self.assertEqual(fizzbuzz(10), 'Buzz')\nself.assertEqual(fizzbuzz(7), '7')\n"
                 "self.assertEqual(fizzbuzz(16), '16')"),
    "wordcount": ("def word_count(text):\n    return len(text.split())\n",
                  ("text.split()", "text.split(' ')"),
                  "self.assertEqual(word_count('a  b c'), 3)\nself.assertEqual(word_count(''), 0)"),
    "fib": ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
            ("range(n)", "range(n - 1)"),
            "self.assertEqual(fib(0), 0)\nself.assertEqual(fib(1), 1)\nself.assertEqual(fib(10), 55)"),
    "factorial": ("def factorial(n):\n    out = 1\n    for k in range(2, n + 1):\n        out *= k\n"
                  "    return out\n",
                  ("range(2, n + 1)", "range(2, n)"),
                  "self.assertEqual(factorial(0), 1)\nself.assertEqual(factorial(5), 120)"),
    "reversewords": ("def reverse_words(text):\n    return ' '.join(reversed(text.split()))\n",
                     ("' '.join(reversed(text.split()))", "text[::-1]"),
                     "self.assertEqual(reverse_words('one two three'), 'three two one')"),
    "bsearch": ("def bsearch(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n"
                "        mid = (lo + hi) // 2\n        if xs[mid] == target:\n            return mid\n"
                "        if xs[mid] < target:\n            lo = mid + 1\n        else:\n"
                "            hi = mid - 1\n    return -1\n",
                ("while lo <= hi", "while lo < hi"),
                "self.assertEqual(bsearch([1, 3, 5, 7], 7), 3)\nself.assertEqual(bsearch([1, 3, 5], 1), 0)\n"
                "self.assertEqual(bsearch([1, 3, 5], 4), -1)\nself.assertEqual(bsearch([2], 2), 0)"),
    "chunk": ("def chunk(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]\n",
              ("range(0, len(xs), n)", "range(0, len(xs) - 1, n)"),
              "self.assertEqual(chunk([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]])\n"
              "self.assertEqual(chunk([1, 2], 1), [[1], [2]])"),
    "flatten": ("def flatten(items):\n    out = []\n    for item in items:\n"
                "        if isinstance(item, list):\n            out.extend(flatten(item))\n"
                "        else:\n            out.append(item)\n    return out\n",
                ("out.extend(flatten(item))", "out.extend(item)"),
                "self.assertEqual(flatten([1, [2, [3, [4]]]]), [1, 2, 3, 4])"),
    "roman": ("PAIRS = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'),\n"
              "         (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]\n\n\n"
              "def roman(n):\n    out = ''\n    for value, letters in PAIRS:\n        while n >= value:\n"
              "            out += letters\n            n -= value\n    return out\n",
              ("(4, 'IV'), ", ""),
              "self.assertEqual(roman(4), 'IV')\nself.assertEqual(roman(1994), 'MCMXCIV')"),
    "fahrenheit": ("def to_fahrenheit(celsius):\n    return celsius * 9 / 5 + 32\n",
                   ("celsius * 9 / 5", "celsius * 5 / 9"),
                   "self.assertEqual(to_fahrenheit(100), 212)\nself.assertEqual(to_fahrenheit(0), 32)"),
    "leapyear": ("def is_leap(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
                 (" or year % 400 == 0", ""),
                 "self.assertTrue(is_leap(2000))\nself.assertFalse(is_leap(1900))\n"
                 "self.assertTrue(is_leap(2024))\nself.assertFalse(is_leap(2023))"),
    "dedupe": ("def dedupe(xs):\n    seen = set()\n    out = []\n    for x in xs:\n"
               "        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out\n",
               ("    return out\n", "    return sorted(out)\n"),
               "self.assertEqual(dedupe([3, 1, 3, 2, 1]), [3, 1, 2])"),
    "vowels": ("def count_vowels(text):\n    return sum(1 for c in text.lower() if c in 'aeiou')\n",
               ("'aeiou'", "'aeio'"),
               "self.assertEqual(count_vowels('Queue Up'), 5)"),
    "caesar": ("def caesar(text, k):\n    out = []\n    for c in text:\n        if c.islower():\n"
               "            out.append(chr((ord(c) - 97 + k) % 26 + 97))\n        else:\n"
               "            out.append(c)\n    return ''.join(out)\n",
               ("(ord(c) - 97 + k) % 26 + 97", "ord(c) + k"),
               "self.assertEqual(caesar('xyz', 3), 'abc')\nself.assertEqual(caesar('a b', 1), 'b c')"),
    "median": ("def median(xs):\n    xs = sorted(xs)\n    mid = len(xs) // 2\n    if len(xs) % 2:\n"
               "        return xs[mid]\n    return (xs[mid - 1] + xs[mid]) / 2\n",
               ("    xs = sorted(xs)\n", ""),
               "self.assertEqual(median([3, 1, 2]), 2)\nself.assertEqual(median([4, 1, 3, 2]), 2.5)"),
    "mergedicts": ("def merge(base, override):\n    out = dict(base)\n    out.update(override)\n    return out\n",
                   ("    out = dict(base)\n    out.update(override)\n",
                    "    out = dict(override)\n    out.update(base)\n"),
                   "self.assertEqual(merge({'a': 1, 'b': 2}, {'b': 3}), {'a': 1, 'b': 3})"),
    "runningtotal": ("def running_total(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n"
                     "        out.append(total)\n    return out\n",
                     ("    for x in xs:\n", "    for x in xs[1:]:\n"),
                     "self.assertEqual(running_total([1, 2, 3]), [1, 3, 6])"),
    "titlecase": ("def title_case(text):\n    return ' '.join(w[:1].upper() + w[1:].lower() for w in text.split())\n",
                  ("w[1:].lower()", "w[1:]"),
                  "self.assertEqual(title_case('hELLO wORLD'), 'Hello World')"),
    "gcd": ("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
            ("    return a\n", "    return b\n"),
            "self.assertEqual(gcd(12, 18), 6)\nself.assertEqual(gcd(7, 5), 1)"),
    "isprime": ("def is_prime(n):\n    if n < 2:\n        return False\n    k = 2\n    while k * k <= n:\n"
                "        if n % k == 0:\n            return False\n        k += 1\n    return True\n",
                ("k * k <= n", "k * k < n"),
                "self.assertFalse(is_prime(1))\nself.assertFalse(is_prime(9))\nself.assertFalse(is_prime(25))\n"
                "self.assertTrue(is_prime(13))"),
    "parsekv": ("def parse_kv(text):\n    out = {}\n    for pair in text.split(';'):\n        if pair:\n"
                "            key, _, value = pair.partition('=')\n            out[key.strip()] = value.strip()\n"
                "    return out\n",
                ("text.split(';')", "text.split(',')"),
                "self.assertEqual(parse_kv('a=1; b = 2;'), {'a': '1', 'b': '2'})"),
    "secondlargest": ("def second_largest(xs):\n    return sorted(set(xs))[-2]\n",
                      ("[-2]", "[-1]"),
                      "self.assertEqual(second_largest([5, 1, 5, 3]), 3)"),
    "rotate": ("def rotate(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n"
               "    return xs[-k:] + xs[:-k] if k else list(xs)\n",
               ("    k %= len(xs)\n", ""),
               "self.assertEqual(rotate([1, 2, 3], 1), [3, 1, 2])\nself.assertEqual(rotate([1, 2, 3], 4), [3, 1, 2])\n"
               "self.assertEqual(rotate([], 2), [])"),
    "snakecase": ("import re\n\n\ndef snake_case(name):\n    return re.sub(r'(?<!^)(?=[A-Z])', '_', name).lower()\n",
                  (").lower()", ")"),
                  "self.assertEqual(snake_case('HelloWorld'), 'hello_world')"),
    "digitsum": ("def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))\n",
                 ("str(abs(n))", "str(n).lstrip('-')[1:]"),
                 "self.assertEqual(digit_sum(-123), 6)\nself.assertEqual(digit_sum(5), 5)"),
    "transpose": ("def transpose(rows):\n    return [list(col) for col in zip(*rows)]\n",
                  ("zip(*rows)", "rows"),
                  "self.assertEqual(transpose([[1, 2], [3, 4]]), [[1, 3], [2, 4]])"),
    "safediv": ("def safe_div(a, b):\n    if b == 0:\n        return None\n    return a / b\n",
                ("    if b == 0:\n        return None\n", ""),
                "self.assertIsNone(safe_div(1, 0))\nself.assertEqual(safe_div(6, 3), 2)"),
    "histogram": ("def histogram(xs):\n    counts = {}\n    for x in xs:\n        counts[x] = counts.get(x, 0) + 1\n"
                  "    return counts\n",
                  ("counts.get(x, 0)", "counts.get(x, 1)"),
                  "self.assertEqual(histogram('abca'), {'a': 2, 'b': 1, 'c': 1})"),
    "stripcomment": ("def strip_comment(line):\n    return line.split('#', 1)[0].rstrip()\n",
                     ("[0].rstrip()", "[0]"),
                     "self.assertEqual(strip_comment('x = 1  # one'), 'x = 1')"),
}
EVAL = ["bsearch", "caesar", "isprime", "median", "rotate", "roman", "leapyear", "flatten"]
SYSTEM = ("You are a careful engineer working in a Linux box with bash. The repository is in /app, "
          "your working folder.")


def names_of(source: str) -> list[str]:
    return [line.split()[1].split("(")[0] for line in source.splitlines() if line.startswith("def ")]


def test_file(name: str, tests: str) -> str:
    body = "\n".join("        " + line for line in tests.splitlines())
    return (f"import unittest\n\nfrom {name} import {', '.join(names_of(BUGS[name][0]))}\n\n\n"
            f"class Test{name.title()}(unittest.TestCase):\n    def test_{name}(self):\n{body}\n\n\n"
            "if __name__ == \"__main__\":\n    unittest.main()\n")


def task(name: str) -> list[dict]:
    prompt = (f"The Python module /app/{name}.py has a bug: the tests in /app/tests fail. Find the bug "
              f"and fix it in {name}.py, without changing the tests. Check with `python3 -m unittest "
              "discover -s tests`, and end your turn once they pass.")
    return [
        {"id": "solver", "type": "deploy_agent", "agent_name": "solver", "system_prompt": SYSTEM},
        {"id": "repo", "type": "load_artifact", "agent_name": "solver", "artifact_id": f"{name}-repo",
         "destination_path": "/app"},
        {"id": "fix", "type": "prompt_agent", "agent_name": "solver", "prompt": prompt},
        # After the turn (nothing of the agent's runs on), the judge and the tests as written, in
        # a folder loaded afresh: what the turn left at that path is gone.
        {"id": "judge", "type": "load_artifact", "agent_name": "solver",
         "artifacts": [{"id": RUNNER}, {"id": f"{name}-tests"}], "destination_path": VERIFY_DIR},
        # The trusted runner: the tests and their assertions run in its process, the module in a
        # child that only hands back values; exit 0 only if every test of the file ran and passed.
        # 40 s: well past what the tests take, and inside the 55 s OpenEnv clients are answered
        # within by default, so tests a model made hang are its 0 there too, never a missed reply.
        {"id": "unit-tests", "type": "run_container_unit_tests_verifier", "agent_name": "solver",
         "command": f"python3 -I -S {VERIFY_DIR}/run_tests.py /app/{name}.py "
                    f"{VERIFY_DIR}/test_{name}.py",
         "user": "agent", "timeout_sec": 40, "fail_task_on_error": False},
    ]


def check(name: str, fixed: str, buggy: str, tests: str) -> None:
    """The tests pass on the fix and fail on the bug, run as the model runs them and as the
    trusted runner does."""
    for source, passes in ((fixed, True), (buggy, False)):
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / f"{name}.py").write_text(source)
            (Path(folder) / "tests").mkdir()
            (Path(folder) / "tests" / f"test_{name}.py").write_text(tests)
            ran = subprocess.run([sys.executable, "-m", "unittest", "discover", "-s", "tests"],
                                 cwd=folder, capture_output=True, timeout=30)
            assert (ran.returncode == 0) == passes, (name, passes, ran.stderr.decode())
            judged = subprocess.run([sys.executable, "-I", "-S", str(JUDGE),
                                     f"{folder}/{name}.py", f"{folder}/tests/test_{name}.py"],
                                    capture_output=True, timeout=60)
            assert (judged.returncode == 0) == passes, (name, passes, judged.stdout.decode(),
                                                        judged.stderr.decode())


def main() -> None:
    for sub in ("tasks", "artifacts", "reference", "evals"):
        for made in (HERE / sub).glob("*"):
            if made != JUDGE.parent:
                shutil.rmtree(made) if made.is_dir() else made.unlink()
        (HERE / sub).mkdir(exist_ok=True)
    for name, (fixed, (good, bad), tests) in BUGS.items():
        assert fixed.count(good) == 1, name
        buggy = fixed.replace(good, bad)
        tests_py = test_file(name, tests)
        check(name, fixed, buggy, tests_py)
        repo = HERE / "artifacts" / f"{name}-repo"
        (repo / "tests").mkdir(parents=True)
        (repo / f"{name}.py").write_text(buggy)
        (repo / "tests" / f"test_{name}.py").write_text(tests_py)
        (HERE / "artifacts" / f"{name}-tests").mkdir()
        (HERE / "artifacts" / f"{name}-tests" / f"test_{name}.py").write_text(tests_py)
        (HERE / "reference" / f"{name}.py").write_text(fixed)
        (HERE / "tasks" / f"{name}.json").write_text(json.dumps(task(name), indent=1) + "\n")
    train = [n for n in BUGS if n not in EVAL]
    for split, names in (("train", train), ("eval", EVAL)):
        (HERE / "evals" / f"{split}.toml").write_text(
            "tasks = [\n" + "".join(f'  "{n}",\n' for n in names) + "]\n")
    print(f"wrote {len(BUGS)} tasks: {len(train)} train, {len(EVAL)} eval")


if __name__ == "__main__":
    main()
