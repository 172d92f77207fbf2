"""Tests of the GridSim bundle (bundles/gridsim-v1): the battery rules, the exact optimum, the
grading, the generator, the bundle as agentenv.py loads it, and episodes played in the local
sandbox and in a real Docker container.

Async code runs with ``asyncio.run`` per test (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import random
from pathlib import Path

import pytest


import agentenv
from tests.harness import GRIDSIM, gridsim_battery, load_module, run

battery = gridsim_battery()
Battery, InvalidSchedule = battery.Battery, battery.InvalidSchedule


generate = load_module("gridsim_generate", GRIDSIM / "generate.py")
baselines = load_module("gridsim_baselines", GRIDSIM / "baselines.py")


# ---------------------------------------------------------------- the exact optimum

def brute_force(cents: list[int], bat: Battery) -> int:
    """The best profit over every schedule of [-P, P]^hours that keeps the charge in [0, E]."""
    p, e = bat.power_mw, bat.capacity_mwh
    best = None
    for schedule in itertools.product(range(-p, p + 1), repeat=len(cents)):
        charge, ok = bat.initial_charge_mwh, True
        for action in schedule:
            charge += action
            if not 0 <= charge <= e:
                ok = False
                break
        if ok:
            value = battery.profit(list(schedule), cents, bat)
            best = value if best is None else max(best, value)
    return best


def test_the_dp_matches_brute_force_on_small_days():
    r = random.Random(1)
    cases = 0
    for power in (1, 2):
        for duration in (1, 2):
            for eta in (0.8, 0.85, 0.92, 1.0):
                for start in range(power * duration + 1):
                    hours = 4 if power == 2 else 5
                    cents = [r.randint(-3000, 9000) for _ in range(hours)]
                    if r.random() < 0.3:
                        cents[r.randrange(hours)] = -r.randint(1, 5000)   # a negative hour
                    bat = Battery(power, duration, eta, start)
                    value, schedule = battery.optimum(cents, bat)
                    assert value == brute_force(cents, bat), (cents, bat)
                    assert battery.profit(schedule, cents, bat) == value
                    cases += 1
    assert cases == 4 * (2 + 3) + 4 * (3 + 5)


def test_the_dp_on_hand_checked_days():
    # buy 1 MWh at $10, sell it at $100 with eta 0.9: 90 - 10 = $80
    bat = Battery(1, 1, 0.9, 0)
    assert battery.optimum([1000, 10000], bat) == (80 * 10_000, [1, -1])
    # a negative price pays for charging: take $5 for charging, and sell at $20 x 0.8
    assert battery.optimum([-500, 2000], Battery(1, 1, 0.8, 0))[0] == (5 + 16) * 10_000
    # a full battery and falling prices: sell the starting charge at once
    assert battery.optimum([5000, 4000, 3000], Battery(2, 1, 0.85, 2)) == (85 * 10_000, [-2, 0, 0])
    # nothing to earn: flat prices and an empty battery (eta < 1 makes every round trip lose)
    assert battery.optimum([3000] * 24, Battery(3, 2, 0.9, 0))[0] == 0


def test_the_optimum_of_a_full_day_is_a_valid_schedule():
    r = random.Random(2)
    for _ in range(20):
        bat = generate.random_battery(r)
        prices = [round(r.uniform(-20, 300), 2) for _ in range(24)]
        cents = battery.prices_cents(prices)
        value, schedule = battery.optimum(cents, bat)
        assert battery.validate(schedule, bat) == schedule
        assert battery.profit(schedule, cents, bat) == value >= 0
        assert battery.profit(baselines.greedy({"battery": bat.as_dict(),
                                                "prices_usd_per_mwh": prices}), cents, bat) <= value


# ---------------------------------------------------------------- grading

def test_grading_corners():
    o = 1_234_567
    assert battery.score(None, o) == 0.0                 # no valid submission
    assert battery.score(0, o) == 0.2                    # idle, exactly
    assert battery.score(o, o) == 1.0                    # the optimum, exactly
    assert battery.score(o // 2, o) == pytest.approx(0.2 + 0.8 * (o // 2) / o)
    loss = battery.score(-(o // 4), o)
    assert 0.0 <= loss < 0.2 and loss == pytest.approx(0.2 * (1 - (o // 4) / o))
    assert battery.score(-o, o) == 0.0 and battery.score(-5 * o, o) == 0.0
    profits = list(range(-2 * o, o + 1, o // 50)) + [o]
    scores = [battery.score(p, o) for p in profits]
    assert scores == sorted(scores)                      # monotone in the profit
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert battery.score(-1, o) < 0.2 < battery.score(1, o)


def test_idle_and_optimum_are_exact_on_real_days_of_the_bundle():
    for path in sorted((GRIDSIM / "tasks").glob("*.json"))[:200]:
        args = json.loads(path.read_text())[1]["directives"][0]["args"]
        bat = Battery.from_dict(args["battery"])
        cents = battery.prices_cents(args["prices_usd_per_mwh"])
        value, schedule = battery.optimum(cents, bat)
        assert battery.score(battery.profit([0] * 24, cents, bat), value) == 0.2
        assert battery.score(battery.profit(schedule, cents, bat), value) == 1.0


# ---------------------------------------------------------------- invalid schedules

BAT = Battery(power_mw=3, duration_h=2, efficiency=0.85, initial_charge_mwh=2)   # E = 6


@pytest.mark.parametrize("schedule, hour, words", [
    ([0] * 23, None, ["23 actions", "exactly 24"]),
    ([0] * 25, None, ["25 actions", "exactly 24"]),
    ("[0, 0]", None, ["JSON array of 24 integers", "str"]),
    ([0] * 4 + [1.5] + [0] * 19, 5, ["hour 5", "1.5", "not an integer"]),
    ([0] * 6 + ["1"] + [0] * 17, 7, ["hour 7", "'1'", "not an integer"]),
    ([True] + [0] * 23, 1, ["hour 1", "not an integer"]),
    ([0, 0, 4] + [0] * 21, 3, ["hour 3", "action 4", "power limit", "P = 3 MW", "-3 to 3"]),
    ([0, -4] + [0] * 22, 2, ["hour 2", "action -4", "power limit"]),
    ([3, 0, 2] + [0] * 21, 3, ["hour 3", "action 2", "5 MWh", "7 MWh", "capacity E = 6 MWh",
                               "at most 1"]),
    ([-2, 0, 0, -1] + [0] * 20, 4, ["hour 4", "action -1", "0 MWh", "below empty", "at most 0"]),
])
def test_invalid_schedules_name_the_hour_and_the_rule(schedule, hour, words):
    with pytest.raises(InvalidSchedule) as caught:
        battery.validate(schedule, BAT)
    assert caught.value.hour == hour
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_valid_edges_are_accepted():
    assert battery.validate([3, 1] + [-3, -3] + [0] * 20, BAT)          # fills to E, empties to 0
    assert battery.charges([3, 1, -3, -3] + [0] * 20, BAT)[:4] == [5, 6, 3, 0]


def test_the_day_is_checked():
    with pytest.raises(ValueError, match="whole cents"):
        battery.prices_cents([1.234] + [0.0] * 23)
    with pytest.raises(ValueError, match="hundredths"):
        Battery.from_dict({"power_mw": 1, "duration_h": 1, "round_trip_efficiency": 0.855,
                           "initial_charge_mwh": 0})
    with pytest.raises(ValueError, match="starting charge"):
        Battery.from_dict({"power_mw": 1, "duration_h": 2, "round_trip_efficiency": 0.85,
                           "initial_charge_mwh": 3})


# ---------------------------------------------------------------- the generator

def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for sub in ("tasks", "evals") for p in sorted((folder / sub).iterdir())}


def _days(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text())[1]["directives"][0]["args"]
            for p in (folder / "tasks").glob("*.json")}


def test_the_generator_is_deterministic(tmp_path):
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        assert generate.main(["--seed", str(seed), "--out", str(tmp_path / name),
                              "--train", "12", "--eval", "4"]) == 0
    a, b, c = (_files(tmp_path / n) for n in "abc")
    assert len(a) == 16 + 2
    assert a == b
    assert a != c and set(a) != set(c)
    days = _days(tmp_path / "a")
    for day in days.values():
        cents = battery.prices_cents(day["prices_usd_per_mwh"])
        assert battery.optimum_profit(cents, Battery.from_dict(day["battery"])) > 0
    # the folder it wrote is a bundle of its own, with the env and the verifier copied in
    loaded = agentenv.Bundle.load(tmp_path / "a")
    assert [len(loaded.splits[s]) for s in ("all", "train", "eval")] == [16, 12, 4]


def test_the_shipped_tasks_are_what_the_generator_writes(tmp_path):
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert _files(tmp_path) == _files(GRIDSIM)


def _csv(path: Path, days: dict[tuple[str, str], list], extra: str = "") -> Path:
    lines = ["date,hub,hour,price"]
    for (date, hub), prices in days.items():
        lines += [f"{date},{hub},{h},{p}" for h, p in enumerate(prices, 1)]
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def test_csv_days_become_tasks_and_zero_optimum_days_are_skipped(tmp_path):
    r = random.Random(3)
    days = {}
    for n in range(12):
        date = (dt.date(2023, 7, 1) + dt.timedelta(days=n)).isoformat()
        days[(date, "HB_NORTH")] = [round(r.uniform(-5, 120), 2) for _ in range(24)]
        days[(date, "LZ_WEST")] = [0] * 24 if n % 3 == 0 else \
            [round(r.uniform(10, 90), 3) for _ in range(24)]   # rounded to the cent on reading
    out = tmp_path / "real"
    assert generate.main(["--csv", str(_csv(tmp_path / "dam.csv", days)), "--out", str(out),
                          "--train", "100", "--eval", "10"]) == 0
    made = _days(out)
    assert len(made) == 24 - 4                            # the four all-zero days are skipped
    assert all(name.endswith("-r") and day["price_source"] == "real" for name, day in made.items())
    assert not [d for d in made.values() if d["hub"] == "LZ_WEST" and set(d["prices_usd_per_mwh"]) == {0}]
    bundle = agentenv.Bundle.load(out)
    train_dates = {t.name[7:17] for t in bundle.splits["train"]}
    eval_dates = {t.name[7:17] for t in bundle.splits["eval"]}
    assert eval_dates and train_dates and not train_dates & eval_dates
    assert 2 <= len(bundle.splits["eval"]) <= 3            # 20 x 10 / 110, by whole dates


@pytest.mark.parametrize("body, words", [
    ("date,hub,hr,price\n", ["lacks the column(s) hour"]),
    ("date,hub,hour,price\n2023-07-01,HB_NORTH,25,10\n", ["line 2", "hour '25'", "1 to 24"]),
    ("date,hub,hour,price\n07/01/2023,HB_NORTH,1,10\n", ["line 2", "YYYY-MM-DD"]),
    ("date,hub,hour,price\n2023-07-01,HB_NORTH,1,abc\n", ["line 2", "price 'abc'"]),
    ("date,hub,hour,price\n2023-07-01,hb north,1,10\n", ["line 2", "hub 'hb north'"]),
    ("date,hub,hour,price\n2023-07-01,HB_NORTH,1,10\n2023-07-01,HB_NORTH,1,11\n",
     ["line 3", "hour 1 appears a second time"]),
    ("date,hub,hour,price\n" + "".join(f"2023-07-01,HB_NORTH,{h},10\n" for h in range(1, 24)),
     ["2023-07-01 HB_NORTH lacks the hour(s) [24]"]),
])
def test_csv_problems_are_reported_clearly(tmp_path, body, words):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(SystemExit) as caught:
        generate.main(["--csv", str(path), "--out", str(tmp_path / "out")])
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the verifier

def test_the_verifier_reads_json_and_sse_replies():
    """verify() against a stand-in MCP server whose grade reply comes as JSON, then as SSE."""
    import http.server
    import threading

    verify = load_module("gridsim_verify", GRIDSIM / "artifacts" / "check_schedule" / "verify.py").verify
    grade = {"score": 0.6, "profit": 12.5, "optimum_profit": 25.0, "valid_submission": True,
             "submissions": 2}
    mode = {"sse": False}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_DELETE(self):
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            msg = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if "id" not in msg:
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            result = {"protocolVersion": "2025-06-18", "capabilities": {}} \
                if msg["method"] == "initialize" else \
                {"content": [{"type": "text", "text": json.dumps(grade)}], "isError": False}
            reply = json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result})
            if mode["sse"] and msg["method"] == "tools/call":
                ping = json.dumps({"jsonrpc": "2.0", "method": "notifications/progress"})
                body, kind = f"event: message\ndata: {ping}\n\nevent: message\ndata: {reply}\n\n", \
                    "text/event-stream"
            else:
                body, kind = reply, "application/json"
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Mcp-Session-Id", "s1")
            self.send_header("Content-Length", str(len(body.encode())))
            self.end_headers()
            self.wfile.write(body.encode())

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/mcp"
    try:
        for sse in (False, True):
            mode["sse"] = sse
            rows = asyncio.run(verify(url))
            assert rows == [{"id": "schedule_score", "result": False, "score": 0.6,
                             "description": rows[0]["description"]}]
            assert "$12.5000" in rows[0]["description"] and "$25.0000" in rows[0]["description"]
    finally:
        server.shutdown()
        server.server_close()
    assert agentenv.aggregate_score(rows, "weighted_average") == 0.6


# ---------------------------------------------------------------- the bundle

@pytest.fixture(scope="module")
def bundle():
    return agentenv.Bundle.load(GRIDSIM)


def test_the_bundle_loads_with_disjoint_splits(bundle):
    assert bundle.description.startswith("GridSim")
    sizes = {name: len(tasks) for name, tasks in bundle.splits.items()}
    assert sizes == {"all": 2200, "train": 2000, "eval": 200}
    train = {t.name for t in bundle.splits["train"]}
    evals = {t.name for t in bundle.splits["eval"]}
    assert not train & evals and train | evals == {t.name for t in bundle.splits["all"]}
    assert not {n[7:17] for n in train} & {n[7:17] for n in evals}     # no date in both
    for task in bundle.splits["all"]:
        assert task.scoring_steps == ("score",) and task.reward_step == "score"
        assert task.toolset.envs == ("gridsim",) and task.agent == "operator"
    hubs = {t.name.split("-")[5] for t in bundle.splits["all"]}
    assert hubs == {"HB_HOUSTON", "HB_NORTH", "HB_SOUTH", "HB_WEST", "HB_HUBAVG"}


def _prompt(turn) -> dict:
    prompt = json.loads(turn.prompt)
    assert prompt["tier"] == "foresight" and prompt["market"] == "ERCOT DAM"
    return prompt


async def _play(runtime, task, moves) -> tuple[list, float | None]:
    """Play one episode: each move maps the prompt to a schedule (or raw arguments)."""
    episode = runtime.episode(task)
    turn = await episode.next_turn()
    prompt = _prompt(turn)
    answers = []
    for move in moves:
        answers.append(await turn.call("submit_schedule", move(prompt), 30))
    turn.end("done")
    outcome = await episode.result()
    assert outcome.status == "scored", outcome
    return answers, outcome.reward


def _schedule(policy):
    return lambda prompt: {"schedule": policy(prompt)}


def _room_to_charge(task) -> bool:
    bat = json.loads(task.first_prompt[0])["battery"]
    return bat["initial_charge_mwh"] < bat["capacity_mwh"]


def test_local_episodes_score_optimal_idle_and_invalid(bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_STATE_DIR", str(tmp_path / "state"))
    task = next(t for t in bundle.splits["eval"] if _room_to_charge(t))

    def over_capacity(prompt):
        p = prompt["battery"]["power_mw"]
        return {"schedule": [p] * 24}          # keeps charging past E at some hour

    def loss(prompt):
        prices = prompt["prices_usd_per_mwh"]
        bat = Battery.from_dict(prompt["battery"])
        dear = max(range(24), key=lambda h: prices[h])
        buy = min(bat.power_mw, bat.capacity_mwh - bat.initial_charge_mwh)
        return {"schedule": [buy if h == dear else 0 for h in range(24)]}   # buy at the top

    async def main():
        async with agentenv.Runtime(bundle, agentenv.Settings.of(sandbox="local")) as runtime:
            episode = runtime.episode(task)
            turn = await episode.next_turn()
            assert [t["name"] for t in turn.tools] == ["submit_schedule"]     # grade is hidden
            refused = await turn.call("grade", {}, 30)
            assert refused.is_error and "no tool 'grade'" in refused.text
            await episode.abandon("done looking")
            return await asyncio.gather(
                _play(runtime, task, [_schedule(baselines.optimal)]),
                _play(runtime, task, [_schedule(baselines.idle)]),
                _play(runtime, task, [over_capacity, lambda _: {"schedule": [0] * 23}]),
                _play(runtime, task, [_schedule(baselines.idle), _schedule(baselines.optimal),
                                      over_capacity]),
                _play(runtime, task, [_schedule(baselines.optimal), loss]),
                _play(runtime, task, [lambda _: {}, lambda _: {"schedule": [0] * 24, "x": 1}]),
            )

    optimal, idle, invalid, last_valid, worse, bad_args = run(main())
    assert optimal[1] == 1.0 and not optimal[0][0].is_error
    assert "valid schedule recorded: profit $" in optimal[0][0].text
    assert idle[1] == 0.2 and "profit $0.0000" in idle[0][0].text
    answers, reward = invalid
    assert reward == 0.0
    assert answers[0].is_error and "invalid schedule" in answers[0].text
    assert "above the capacity E" in answers[0].text and "hour " in answers[0].text
    assert answers[1].is_error and "23 actions" in answers[1].text
    assert last_valid[1] == 1.0 and last_valid[0][2].is_error    # the invalid one changes nothing
    assert worse[1] < 0.2 and not worse[0][1].is_error           # the last valid one counts
    assert bad_args[1] == 0.0 and all(a.is_error for a in bad_args[0])
    assert "'schedule'" in bad_args[0][0].text and "unexpected" in bad_args[0][1].text


def test_a_docker_episode_scores_the_optimum(bundle, docker_client):
    task = bundle.splits["eval"][1]

    async def main():
        async with agentenv.Runtime(bundle, agentenv.Settings.of(sandbox="docker")) as runtime:
            assert runtime.sandbox.kind == "docker"
            return await _play(runtime, task, [_schedule(baselines.optimal)])

    answers, reward = run(main(), timeout=300)
    assert not answers[0].is_error
    assert reward == 1.0
    left = docker_client.containers.list(all=True, filters={"label": "agentenv.env=gridsim"})
    assert not [c for c in left if c.labels.get("agentenv.owner") == agentenv.owner_id()]
