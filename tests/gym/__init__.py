"""Helpers of the NeMo Gym tests (not collected by pytest on its own: no ``test_*.py`` here).

* ``fake_model``: a scripted OpenAI-Responses model server (aiohttp); the data row carries its script.
* ``harness``: check the Gym venv built by ``.ci/gym-venv.sh``, run a resources server under the real
  NeMo Gym 0.7 ``simple_agent`` (lightest variant, no CLI and no Ray) or under the full
  ``gym env start`` + ``gym eval run --no-serve`` CLI, and always stop every process started.
* ``standin/``: a tiny resources server written without nemo_gym, used to prove the harness.

Import them as ``tests.gym.<module>`` with the repository root on ``sys.path`` (``tests/`` is a
namespace package; a bare ``gym`` would be ambiguous).
"""
