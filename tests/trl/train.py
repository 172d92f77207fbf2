"""train.py: TRL 1.16's real GRPOTrainer on a bundle through agentenv.trl_environment, run by
tests/test_trl.py with the TRL venv's python (.ci/trl-venv.sh), as a user's script runs it.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on the bundles' prompts and
on the conversations of the warm-up, wrapped with TRL's own copy of Qwen3's chat template (so TRL
attaches its tool-call parser), and the model a random tiny Qwen3. A short supervised warm-up on
conversations of the format the tasks want (a tool call, its answer, a reply; some right, some
wrong) makes the sampled rollouts differ, so GRPO has rewards that vary and the weights move.

    python tests/trl/train.py --out result.json --run gridsim=URL --run notes=URL \
        --run gridsim=bundles/gridsim-v1 [--steps 3] [--schemas tools.json] [--compare-resets ROUNDS]

Each ``--run NAME=SOURCE`` trains a copy of NAME's warmed model for --steps GRPO steps against
SOURCE (a running serve, or a bundle folder served in-process with the local sandbox), and the
result file says, per run: TRL's logged reward of each step, the rewards trl_reward returned (and
which episodes they were), how many parameter tensors changed, each step's time and how long
TRL's serial resets took; for a folder, the in-process server's /metrics too. ``--schemas`` adds
transformers' get_json_schema of a class built from the tools in a file (what the model is shown);
``--compare-resets`` trains each run again, with and without resets run ahead
(bench/trl_resets.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import agentenv  # noqa: E402

BUNDLES = {"gridsim": REPO / "bundles" / "gridsim-v1", "notes": REPO / "bundles" / "notes-v1"}
SPLITS = {"gridsim": "train", "notes": "all"}
# The rows trained on: a tiny model warmed up for a minute plays only the days it has seen (it
# can't read prices), so GridSim trains on the first 8 days of its train split, and notes-v1 on
# all three of its tasks.
ROWS = {"gridsim": 8, "notes": 3}
WARM_UP = {"gridsim": 200, "notes": 400}          # supervised steps: enough for rewards to vary
PROMPTS, GENERATIONS = 2, 4


# ================================================================ the warm-up's conversations

def tool_call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def gridsim_conversations(rows: list[dict], rng: random.Random) -> list[list[dict]]:
    """Each day played two ways that differ in the first hour alone, which a tiny model learns in
    a minute: idle all day (it scores 0.2), or selling 1 MWh from the empty battery first (a
    schedule that breaks a rule: 0)."""
    out = []
    for row in rows:
        for first in (0, -1):
            out.append(row["prompt"] + [tool_call("submit_schedule", schedule=[first] + [0] * 23),
                                        {"role": "tool", "name": "submit_schedule",
                                         "content": "profit 0.00"},
                                        {"role": "assistant", "content": "Done."}])
    rng.shuffle(out)
    return out


def notes_conversations(rows: list[dict], rng: random.Random) -> list[list[dict]]:
    """Each notes-v1 task played right and wrong: the recipe's reply, the groceries note, and
    the two turns, the first ended with end_turn (whose answer is the next prompt)."""
    out = []
    by_task = {row["task"]: row for row in rows}
    for right in (True, False):
        recall = by_task["recall-recipe"]["prompt"]
        out.append(recall + [tool_call("read_note", title="pancakes"),
                             {"role": "tool", "name": "read_note",
                              "content": "2 eggs, 1 cup milk, 1 cup flour"},
                             {"role": "assistant", "content": "2" if right else "3"}])
        save = by_task["save-groceries"]["prompt"]
        out.append(save + [tool_call("write_note", title="groceries",
                                     text="eggs and milk" if right else "bread"),
                           {"role": "tool", "name": "write_note", "content": "saved note 'groceries'"},
                           {"role": "assistant", "content": "Saved."}])
        two = by_task["two-step"]["prompt"]
        out.append(two + [tool_call("list_notes"), {"role": "tool", "name": "list_notes",
                                                    "content": "pancakes"},
                          tool_call("end_turn", response="pancakes"),
                          {"role": "tool", "name": "end_turn",
                           "content": "Now save a note titled 'groceries' that lists the "
                                      "ingredients my 'pancakes' note needs."},
                          tool_call("write_note", title="groceries",
                                    text="eggs, milk, flour" if right else "sugar"),
                          {"role": "tool", "name": "write_note", "content": "saved note 'groceries'"},
                          {"role": "assistant", "content": "Saved."}])
    rng.shuffle(out)
    return out


# ================================================================ tokenizer and model, built here

def tokenizer_for(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=4000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    # ordinary tokens, so that TRL's parser sees them in the decoded text
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                          "<think>", "</think>"])
    tokenizer.chat_template = qwen3_chat_template
    return tokenizer


def tiny_model(tokenizer):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def segments(tokenizer, messages: list[dict], tools: list) -> list[tuple[str, bool]]:
    """A conversation as TRL puts it together while it generates: the prompt with its generation
    prompt, then each reply of the model (learned) and each tool's answer (not learned), as TRL's
    tool suffix renders it; (text, learned) pairs."""
    from trl.chat_template_utils import get_training_chat_template

    # TRL renders with Qwen3's prefix-preserving training template, as it does in multi-turn work
    template = get_training_chat_template(tokenizer)

    def render(conversation: list[dict], **kwargs) -> str:
        return tokenizer.apply_chat_template(conversation, tokenize=False, enable_thinking=False,
                                             chat_template=template, **kwargs)

    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    out = [(render(messages[:first], tools=tools, add_generation_prompt=True), False)]
    user = [{"role": "user", "content": "dummy"}]
    opened = render(user, add_generation_prompt=True)
    i = first
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            whole = render(user + [messages[i]])
            assert whole.startswith(opened), (whole, opened)
            out.append((whole[len(opened):].rstrip("\n"), True))
            i += 1
            continue
        answers = []
        while i < len(messages) and messages[i]["role"] == "tool":
            answers.append(messages[i])
            i += 1
        called = [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": answers[0]["name"], "arguments": {}}}]}]
        before = render(user + called)
        before = before[:before.rindex("<|im_end|>") + len("<|im_end|>")]
        after = render(user + called + answers, add_generation_prompt=True)
        assert after.startswith(before), (after, before)
        out.append((after[len(before):], False))
    return out


def warm_up(model, tokenizer, conversations: list[list[dict]], tools: list, steps: int) -> float:
    """Supervised steps on the conversations, the loss on the model's replies; the last loss."""
    import torch

    examples = []
    for messages in conversations:
        ids, labels = [], []
        for text, learned in segments(tokenizer, messages, tools):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            labels += piece if learned else [-100] * len(piece)
        examples.append((torch.tensor([ids]), torch.tensor([labels])))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    model.train()
    rng = random.Random(0)
    loss = None
    for _ in range(steps):
        ids, labels = rng.choice(examples)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return loss.item()


# ================================================================ one GRPO run

def environment(source: str):
    """trl_environment's class, the bundle served in-process with the local sandbox for a folder."""
    return agentenv.trl_environment(source, **({} if source.startswith("http") else
                                               {"sandbox": "local", "max_concurrent_envs": 16}))


def tools_of(Env) -> list:
    """The tool methods, as TRL lists them (every public function but reset)."""
    import inspect
    return [f for n, f in inspect.getmembers(Env, inspect.isfunction)
            if n != "reset" and not n.startswith("_")]


async def deployed(session) -> None:
    """Wait until a rollout's session is open at its first turn (or failed)."""
    await asyncio.shield(session.opened)


def grpo(name: str, source: str, Env, model, tokenizer, steps: int, out: Path,
         serial: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = agentenv.trl_dataset(source, split=SPLITS[name])[:ROWS[name]]

    returned: list[list] = []              # what trl_reward gave, call by call, with the episodes

    def reward(completions, environments, **kwargs):
        rewards = agentenv.trl_reward(completions, environments, **kwargs)
        returned.append([[r, dict(e._row)] for r, e in zip(rewards, environments)])
        return rewards

    reward.__name__ = "trl_reward"
    resets: list[float] = []               # how long each of TRL's reset() calls took

    class Timed(Env):
        def reset(self, **row):
            started = time.monotonic()
            super().reset(**row)
            if serial:         # as without resets run ahead: each waits for its deploy, in turn
                self._client.run(deployed(self._session))
            resets.append(time.monotonic() - started)

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.began = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.monotonic() - self.began)

    said: list[str] = []                   # what agentenv said (a rollout left out, and why)

    class Said(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    listening = Said(logging.WARNING)
    logging.getLogger("agentenv").addHandler(listening)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    timer = StepTimes()
    config = GRPOConfig(
        output_dir=str(out.parent / f"grpo-{name}"), use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, max_steps=steps, learning_rate=1e-4,
        per_device_train_batch_size=PROMPTS * GENERATIONS, num_generations=GENERATIONS,
        max_completion_length=192, max_tool_calling_iterations=6, temperature=1.0,
        chat_template_kwargs={"enable_thinking": False}, seed=0, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward,
                          environment_factory=Timed, train_dataset=Dataset.from_list(rows),
                          args=config, callbacks=[timer])
    try:
        trainer.train()
    finally:
        logging.getLogger("agentenv").removeHandler(listening)
    logged = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    changed = sum(1 for k, v in model.named_parameters() if not torch.equal(v.detach(), before[k]))
    result = {"name": name, "source": source, "serial_resets": serial, "logged_rewards": logged,
              "returned": returned,
              "said": said, "changed_tensors": changed, "tensors": len(before), "step_seconds": timer.times,
              "reset_seconds": resets, "pool": len(trainer._environment_pool[None]),
              "tool_calls": [entry.get("tools/call_frequency") for entry in trainer.state.log_history
                             if "reward" in entry]}
    if not source.startswith("http"):                    # the in-process server's own count
        with urllib.request.urlopen(Env._client.served.url + "/metrics", timeout=30) as page:
            result["metrics"] = page.read().decode()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", action="append", required=True, metavar="NAME=SOURCE")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare-resets", type=int, default=0, metavar="ROUNDS",
                        help="train each run again 2 x ROUNDS times, in turn with resets run ahead "
                             "and with each reset waiting for its deploy (as TRL's serial resets "
                             "do without them), alternating which goes first: bench/trl_resets.py")
    parser.add_argument("--schemas", type=Path, metavar="TOOLS_JSON",
                        help="tools (as serve lists them): their schemas as the model is shown them")
    args = parser.parse_args()
    started = time.monotonic()
    runs = [run.split("=", 1) for run in args.run]
    rng = random.Random(0)

    # the conversations to warm up on, with the tools as the model will be shown them
    conversations = {}
    for name in dict(runs):
        folder = str(BUNDLES[name])
        rows = agentenv.trl_dataset(folder, SPLITS[name])[:ROWS[name]]
        conversations[name] = gridsim_conversations(rows, rng) if name == "gridsim" \
            else notes_conversations(rows, rng)
    texts = [json.dumps(c) for convs in conversations.values() for c in convs]
    tokenizer = tokenizer_for(texts + [m["content"] for convs in conversations.values() for c in convs
                                       for m in c if isinstance(m.get("content"), str)])
    import copy
    warmed, timings = {}, {"imports_and_tokenizer": time.monotonic() - started}
    results = []
    for name, source in runs:
        Env = environment(source)
        if name not in warmed:
            began = time.monotonic()
            model = tiny_model(tokenizer)
            loss = warm_up(model, tokenizer, conversations[name], tools_of(Env), WARM_UP[name])
            warmed[name] = model
            timings[f"warm_up_{name}"] = time.monotonic() - began
            timings[f"warm_up_{name}_loss"] = loss
        began = time.monotonic()
        results.append(grpo(name, source, Env, copy.deepcopy(warmed[name]), tokenizer, args.steps,
                            args.out))
        timings[f"grpo_{name}_{len(results)}"] = time.monotonic() - began
        for round_ in range(args.compare_resets):
            for serial in ((True, False) if round_ % 2 == 0 else (False, True)):
                results.append(grpo(name, source, Env, copy.deepcopy(warmed[name]), tokenizer,
                                    args.steps, args.out, serial=serial))
    output = {"runs": results, "timings": timings}
    if args.schemas:
        output["schemas"] = schemas(json.loads(args.schemas.read_text()))
    args.out.write_text(json.dumps(output, indent=1))


def schemas(tools: list[dict]) -> dict:
    """transformers' get_json_schema of each tool method of the class trl_class builds, bound to
    an instance as TRL passes them: the tools exactly as the chat template renders them."""
    from transformers.utils import get_json_schema

    cls = agentenv.trl_class("schemas", "tools", tools, None)
    environment = object.__new__(cls)
    return {f.__name__: get_json_schema(getattr(environment, f.__name__)) for f in tools_of(cls)}


if __name__ == "__main__":
    main()
