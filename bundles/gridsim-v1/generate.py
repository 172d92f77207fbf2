"""generate.py: build GridSim's tasks and splits, deterministically from a seed.

    python generate.py                      # the shipped bundle: 2,000 train + 200 eval synthetic days
    python generate.py --seed 7 --out /tmp/g --train 50 --eval 10
    python generate.py --csv dam.csv --out /tmp/gridsim-real   # days from real hourly DAM prices

Writes ``tasks/<task id>.json`` (one JSON array of steps per task, one line), ``evals/train.toml``
and ``evals/eval.toml`` under ``--out`` (default: this folder). Eval days and train days never share
a date. A day whose optimum profit is zero is skipped. Given another ``--out`` than this folder,
the env and the verifier are copied there too, so that folder is a complete bundle.

Synthetic days (the default) are drawn from a price model with the shapes ERCOT hub DAM prices show:
a night trough, a morning peak, a midday solar trough that deepens in spring and over the years,
an evening peak that turns into scarcity on summer evenings, seasonal and yearly levels, rare
scarcity spikes of hundreds to thousands of $/MWh, and occasional negative hours (most on HB_WEST).
They are not ERCOT's prices.

``--csv FILE`` reads real prices instead: a CSV with a header row and the columns ``date``
(YYYY-MM-DD, the operating day), ``hub`` (such as HB_NORTH), ``hour`` (1-24, the hour ending: hour 1
is 00:00-01:00) and ``price`` ($/MWh, rounded to the cent); other columns are ignored. Every
(date, hub) must have each hour 1-24 exactly once. Every such day becomes a task, up to --eval eval
days (whole dates, so a few more when the last date has several hubs) and --train train days; a file
with fewer days than that is shared out in the same proportion.

Standard library only.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
import random
import re
import shutil
import sys
import time
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "envs" / "gridsim"))
import battery  # noqa: E402  (the env's own rules: one definition of the battery and the optimum)

DEFAULT_SEED = 20250601
HUBS = ("HB_HOUSTON", "HB_NORTH", "HB_SOUTH", "HB_WEST", "HB_HUBAVG")
FIRST_DATE, LAST_DATE = dt.date(2018, 1, 1), dt.date(2024, 12, 31)
DURATIONS = (1, 2, 4)
POWERS = (1, 2, 3, 4, 5, 6, 8, 10)
EFFICIENCIES = tuple(round(0.80 + k / 100, 2) for k in range(13))      # 0.80 ... 0.92
PRICE_FLOOR, PRICE_CAP = -250.0, 5000.0       # ERCOT's DAM offer floor and its cap since 2022
TIER, MARKET = "foresight", "ERCOT DAM"
ENV_ID, ARTIFACT, DAY_URI = "gridsim", "check_schedule", "urn:gridsim:day/v1"

SYSTEM_PROMPT = """\
You operate a grid battery in the ERCOT day-ahead market (DAM) for one operating day. The user \
message is a JSON object: the hub and date, the battery, and the day's 24 hourly prices in $/MWh \
(prices_usd_per_mwh[0] is hour 1, 00:00-01:00; prices_usd_per_mwh[23] is hour 24, 23:00-24:00). \
You see all 24 prices before you decide (tier "foresight").

The battery: power limit P = power_mw MW, energy capacity E = capacity_mwh MWh (P x duration_h), \
round-trip efficiency eta = round_trip_efficiency, and charge S = initial_charge_mwh MWh at the \
start of hour 1.

Your schedule is 24 integers, one action a per hour, hour 1 first:
- a > 0 charges a MWh bought from the grid: the charge rises by a, and you pay a x price.
- a < 0 discharges |a| MWh: the charge falls by |a|, and |a| x eta MWh are sold: you earn \
|a| x eta x price.
- a = 0 idles: nothing is paid or earned.
Every action must be an integer from -P to P, and the charge must stay between 0 and E MWh after \
every hour. Prices can be negative: then charging earns money and selling costs money. Charge left \
at the end of hour 24 is worth nothing. The day's profit is the sum of the 24 hourly settlements.

Submit with the submit_schedule tool. It answers with the schedule's profit or, if the schedule \
breaks a rule, which hour breaks which rule. You may submit again; your last valid schedule is the \
one scored. Score: with O the best profit any valid schedule makes on this day and p your profit, \
0.2 + 0.8 x p / O for p >= 0 (idling all day scores 0.2, the optimum 1.0), max(0, 0.2 x (1 + p / O)) \
for a loss, and 0 if no valid schedule was submitted. When you are done, end your turn."""

INSTRUCTIONS = ("Call submit_schedule with 24 integer actions in MWh, hour 1 first "
                "(prices_usd_per_mwh[0] is hour 1, 00:00-01:00). Then end your turn.")

YEAR_LEVEL = {2018: 33.0, 2019: 35.0, 2020: 22.0, 2021: 38.0, 2022: 62.0, 2023: 50.0, 2024: 30.0}
MONTH_LEVEL = (1.00, 1.05, 0.85, 0.85, 0.92, 1.10, 1.25, 1.45, 1.12, 0.90, 0.90, 1.00)
YEAR_SOLAR = {2018: 0.06, 2019: 0.10, 2020: 0.15, 2021: 0.22, 2022: 0.32, 2023: 0.42, 2024: 0.55}
MONTH_SOLAR = (0.40, 0.70, 1.00, 1.20, 1.10, 0.80, 0.60, 0.50, 0.70, 0.80, 0.60, 0.40)
MONTH_SCARCITY = (0.012, 0.012, 0.006, 0.006, 0.008, 0.025, 0.04, 0.07, 0.025, 0.006, 0.006, 0.012)
MONTH_GLUT = (0.03, 0.05, 0.15, 0.18, 0.12, 0.04, 0.02, 0.02, 0.04, 0.08, 0.08, 0.04)
HUB = {  # basis (x level), solar depth (x), night wind (x), noise (log sigma), extra negative odds
    "HB_HOUSTON": (1.03, 0.80, 0.7, 0.07, 0.0),
    "HB_NORTH": (1.00, 1.00, 1.0, 0.07, 0.0),
    "HB_SOUTH": (1.02, 0.95, 0.9, 0.08, 0.0),
    "HB_WEST": (0.92, 1.40, 1.6, 0.13, 0.08),
    "HB_HUBAVG": (0.99, 1.00, 1.0, 0.05, 0.0),
}


# ------------------------------------------------------------------ synthetic prices

def _bump(x: float, center: float, width: float) -> float:
    return math.exp(-0.5 * ((x - center) / width) ** 2)


def _system_day(seed: int, day: dt.date) -> dict:
    """What every hub of a day shares: the level, the weather, the solar, the scarcity."""
    r = random.Random(f"gridsim-v1:{seed}:system:{day.isoformat()}")
    m = day.month - 1
    level = YEAR_LEVEL.get(day.year, 35.0) * MONTH_LEVEL[m] * math.exp(r.gauss(0, 0.22))
    if day.weekday() >= 5:
        level *= 0.85
    summer = day.month in (6, 7, 8, 9)
    winter = day.month in (12, 1, 2)
    scarcity = None
    if r.random() < MONTH_SCARCITY[m]:
        hour = r.choice((18.5, 19.5, 20.5, 21.5)) if not winter else r.choice((7.5, 8.5, 19.5))
        height = math.exp(r.uniform(math.log(150), math.log(4000)))
        scarcity = (hour, height, r.uniform(0.7, 1.8))
    glut = None
    if r.random() < MONTH_GLUT[m] * (0.6 + 0.1 * (day.year - 2018)):
        glut = (r.uniform(5, 35), r.random() < 0.6, r.random() < 0.5)   # depth, midday?, night?
    return {
        "level": level,
        "solar": YEAR_SOLAR.get(day.year, 0.3) * MONTH_SOLAR[m] * r.uniform(0.4, 1.5),
        "evening": (0.85 if day.month in (7, 8) else 0.55 if summer else 0.30) * r.uniform(0.6, 1.4)
                   + 0.5 * YEAR_SOLAR.get(day.year, 0.3) * (1.0 if summer else 0.5),
        "morning": (0.35 if winter else 0.15) * r.uniform(0.5, 1.5),
        "wind": r.uniform(0.0, 0.35) * (1.3 if day.month in (3, 4, 5, 10, 11) else 1.0),
        "scarcity": scarcity,
        "glut": glut,
    }


def synthetic_prices(seed: int, day: dt.date, hub: str) -> list[float]:
    """The 24 synthetic DAM prices ($/MWh, in cents) of a hub on a day; the same for the same seed."""
    system = _system_day(seed, day)
    basis, solar_x, wind_x, sigma, negative_odds = HUB[hub]
    r = random.Random(f"gridsim-v1:{seed}:hub:{day.isoformat()}:{hub}")
    level = system["level"] * basis * math.exp(r.gauss(0, 0.03))
    west_night = r.random() < negative_odds
    noise, prices = 0.0, []
    for hour in range(1, 25):
        mid = hour - 0.5
        shape = (1.0 - (0.22 + system["wind"] * wind_x) * _bump(mid, 3.5, 2.5)
                 + system["morning"] * _bump(mid, 7.5, 1.3)
                 - system["solar"] * solar_x * _bump(mid, 13.0, 2.8)
                 + system["evening"] * _bump(mid, 19.5, 1.8))
        noise = 0.6 * noise + r.gauss(0, sigma)
        price = level * max(shape, 0.05) * math.exp(noise)
        if system["scarcity"]:
            at, height, width = system["scarcity"]
            price += height * _bump(mid, at, width) * r.uniform(0.8, 1.2)
        if system["glut"]:
            depth, midday, night = system["glut"]
            price -= depth * solar_x * (_bump(mid, 13.0, 2.5) if midday else 0.0)
            price -= depth * wind_x * (_bump(mid, 3.5, 2.0) if night else 0.0)
        if west_night:
            price -= r.uniform(8, 25) * _bump(mid, 3.5, 2.2)
        prices.append(round(min(PRICE_CAP, max(PRICE_FLOOR, price)), 2))
    return prices


# ------------------------------------------------------------------ days and tasks

def task_id(day: str, hub: str, duration: int, source: str) -> str:
    return f"dam-v1-{day}-{hub}-{duration}h-{'r' if source == 'real' else 's'}"


def random_battery(r: random.Random) -> battery.Battery:
    power = r.choice(POWERS)
    duration = r.choice(DURATIONS)
    capacity = power * duration
    start = 0 if r.random() < 0.4 else r.randint(0, capacity)
    return battery.Battery(power, duration, r.choice(EFFICIENCIES), start)


def make_day(seed: int, day: str, hub: str, prices: list[float], source: str) -> dict | None:
    """A task's day with its battery, or None when its optimum profit is zero (nothing to earn)."""
    r = random.Random(f"gridsim-v1:{seed}:battery:{day}:{hub}")
    bat = random_battery(r)
    cents = battery.prices_cents(prices)
    if battery.optimum_profit(cents, bat) <= 0:
        return None
    return {"task_id": task_id(day, hub, bat.duration_h, source), "hub": hub, "date": day,
            "battery": bat.as_dict(), "prices_usd_per_mwh": prices, "price_source": source}


def task_steps(day: dict) -> list[dict]:
    prompt = {"task_id": day["task_id"], "tier": TIER, "market": MARKET, "hub": day["hub"],
              "date": day["date"], "price_source": day["price_source"], "battery": day["battery"],
              "prices_usd_per_mwh": day["prices_usd_per_mwh"], "instructions": INSTRUCTIONS}
    return [
        {"id": "env", "type": "deploy_env", "env_id": ENV_ID},
        {"id": "day", "type": "apply_server_config", "env_id": ENV_ID,
         "directives": [{"service": "*", "uri": DAY_URI, "args": day}]},
        {"id": "agent", "type": "deploy_agent", "agent_name": "operator", "env_ids": [ENV_ID],
         "system_prompt": SYSTEM_PROMPT},
        {"id": "schedule", "type": "prompt_agent", "agent_name": "operator", "prompt_id": "schedule",
         "prompt": json.dumps(prompt), "timeout_seconds": 600},
        {"id": "score", "type": "env_outcome_verifier", "env_id": ENV_ID,
         "file_artifact_id": ARTIFACT, "verifier_id": "score", "score_aggregator": "weighted_average"},
    ]


def split_days(dates: list[str], days_of: callable, n_eval: int, n_train: int) -> tuple[list, list]:
    """Eval takes whole dates (in the given order) until it has at least n_eval days; train takes
    the dates after those, up to n_train days. No date gives days to both."""
    evals: list[dict] = []
    train: list[dict] = []
    for date in dates:
        if len(evals) < n_eval:
            evals.extend(days_of(date))
        elif len(train) < n_train:
            train.extend(days_of(date))
        else:
            break
    return evals, train[:n_train]


def synthetic_split(seed: int, n_eval: int, n_train: int) -> tuple[list, list]:
    dates, day = [], FIRST_DATE
    while day <= LAST_DATE:
        dates.append(day.isoformat())
        day += dt.timedelta(days=1)
    random.Random(f"gridsim-v1:{seed}:dates").shuffle(dates)

    def days_of(date: str) -> list[dict]:
        hub = random.Random(f"gridsim-v1:{seed}:hub-of:{date}").choice(HUBS)
        made = make_day(seed, date, hub, synthetic_prices(seed, dt.date.fromisoformat(date), hub),
                        "synthetic")
        return [made] if made else []

    evals, train = split_days(dates, days_of, n_eval, n_train)
    if len(evals) < n_eval or len(train) < n_train:
        raise SystemExit(f"generate.py: the dates {FIRST_DATE} to {LAST_DATE} give only "
                         f"{len(evals)} eval and {len(train)} train days; ask for fewer")
    return evals, train


# ------------------------------------------------------------------ real prices from a CSV

HUB_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def read_csv(path: Path) -> dict[tuple[str, str], list[float]]:
    """{(date, hub): 24 prices} from a CSV of date,hub,hour,price; SystemExit listing every problem."""
    problems: list[str] = []
    hours: dict[tuple[str, str], dict[int, float]] = {}
    try:
        handle = path.open(newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise SystemExit(f"generate.py: can't read {path}: {exc}") from None
    with handle:
        reader = csv.DictReader(handle)
        missing = [c for c in ("date", "hub", "hour", "price") if c not in (reader.fieldnames or [])]
        if missing:
            raise SystemExit(f"generate.py: {path}: the header row lacks the column(s) "
                             f"{', '.join(missing)}; it needs date,hub,hour,price (found "
                             f"{reader.fieldnames})")
        for row in reader:
            at = f"{path.name} line {reader.line_num}"
            date, hub = (row["date"] or "").strip(), (row["hub"] or "").strip()
            try:
                dt.date.fromisoformat(date)
                if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
                    raise ValueError
            except ValueError:
                problems.append(f"{at}: date {date!r} is not a date written YYYY-MM-DD")
                continue
            if not HUB_NAME.match(hub):
                problems.append(f"{at}: hub {hub!r} is not a settlement point name such as HB_NORTH "
                                "(capitals, digits and _)")
                continue
            try:
                hour = int((row["hour"] or "").strip())
                if not 1 <= hour <= 24:
                    raise ValueError
            except ValueError:
                problems.append(f"{at}: hour {row['hour']!r} is not a whole number from 1 to 24 "
                                "(the hour ending: 1 is 00:00-01:00)")
                continue
            try:
                price = Decimal((row["price"] or "").strip())
                if not price.is_finite():
                    raise InvalidOperation
            except InvalidOperation:
                problems.append(f"{at}: price {row['price']!r} is not a number of $/MWh")
                continue
            if not PRICE_FLOOR * 40 <= price <= PRICE_CAP * 40:
                problems.append(f"{at}: price {price} $/MWh is implausible for a DAM price; check "
                                "the units (the column is $/MWh)")
                continue
            seen = hours.setdefault((date, hub), {})
            if hour in seen:
                problems.append(f"{at}: {date} {hub} hour {hour} appears a second time")
                continue
            seen[hour] = float(price.quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN))
    for (date, hub), seen in sorted(hours.items()):
        if len(seen) != 24:
            lacking = [h for h in range(1, 25) if h not in seen]
            problems.append(f"{path.name}: {date} {hub} lacks the hour(s) {lacking}; every day needs "
                            "hours 1-24 exactly once (fix or remove it; ERCOT's daylight-saving days "
                            "have 23 or 25 hours)")
    if not hours and not problems:
        problems.append(f"{path.name}: has no rows after the header")
    if problems:
        shown = problems[:25] + ([f"... and {len(problems) - 25} more"] if len(problems) > 25 else [])
        raise SystemExit(f"generate.py: {path} has {len(problems)} problem(s):\n  - "
                         + "\n  - ".join(shown))
    return {key: [seen[h] for h in range(1, 25)] for key, seen in hours.items()}


def csv_split(seed: int, path: Path, n_eval: int, n_train: int) -> tuple[list, list]:
    prices = read_csv(path)
    days: dict[str, list[dict]] = {}
    for (date, hub), day_prices in sorted(prices.items()):
        made = make_day(seed, date, hub, day_prices, "real")
        if made:
            days.setdefault(date, []).append(made)
    total = sum(len(v) for v in days.values())
    if total < 2:
        raise SystemExit(f"generate.py: {path} gives {total} day(s) with a positive optimum; a train "
                         "and an eval split need at least 2")
    if total < n_eval + n_train:
        share = n_eval / (n_eval + n_train)
        n_eval = max(1, round(total * share))
        n_train = total - n_eval
    dates = sorted(days)
    random.Random(f"gridsim-v1:{seed}:dates").shuffle(dates)
    evals, train = split_days(dates, lambda d: days[d], n_eval, n_train)
    if not evals or not train:
        raise SystemExit(f"generate.py: {path} has too few dates to give eval and train days on "
                         "different dates")
    return evals, train


# ------------------------------------------------------------------ writing

def write_bundle(out: Path, evals: list[dict], train: list[dict], note: str) -> None:
    (out / "tasks").mkdir(parents=True, exist_ok=True)
    (out / "evals").mkdir(parents=True, exist_ok=True)
    for old in (out / "tasks").glob("dam-v1-*.json"):
        old.unlink()
    for day in [*evals, *train]:
        text = json.dumps(task_steps(day), separators=(",", ":")) + "\n"
        (out / "tasks" / f"{day['task_id']}.json").write_text(text)
    for name, days in (("train", train), ("eval", evals)):
        ids = sorted(d["task_id"] for d in days)
        body = "".join(f'  "{i}",\n' for i in ids)
        (out / "evals" / f"{name}.toml").write_text(f"# {note}\ntasks = [\n{body}]\n")
    if out.resolve() != HERE:
        for part in ("envs", "artifacts"):
            shutil.copytree(HERE / part, out / part, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", ".*"))
        if not (out / "README.md").exists():
            (out / "README.md").write_text(f"GridSim battery days built by generate.py ({note}).\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"the seed everything is drawn from (default {DEFAULT_SEED})")
    parser.add_argument("--out", type=Path, default=HERE,
                        help="the bundle folder to write (default: this folder)")
    parser.add_argument("--train", type=int, default=2000, help="train days (default 2000)")
    parser.add_argument("--eval", type=int, default=200, help="eval days (default 200)")
    parser.add_argument("--csv", type=Path, default=None, metavar="FILE",
                        help="real hourly DAM prices: a CSV with columns date,hub,hour,price")
    args = parser.parse_args(argv)
    if args.train < 1 or args.eval < 1:
        parser.error("--train and --eval must be at least 1")
    started = time.monotonic()
    if args.csv:
        evals, train = csv_split(args.seed, args.csv, args.eval, args.train)
        note = f"real prices from {args.csv.name}, seed {args.seed}"
    else:
        evals, train = synthetic_split(args.seed, args.eval, args.train)
        note = f"synthetic prices, seed {args.seed}"
    write_bundle(args.out, evals, train, note)
    print(f"generate.py: wrote {len(train)} train and {len(evals)} eval tasks ({note}) to "
          f"{args.out} in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
