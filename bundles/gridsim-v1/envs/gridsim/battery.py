"""battery: GridSim's battery model, settlement, validation, exact optimum and grading.

Pure functions, standard library only. The env server, the generator, the baselines and the tests
all import this one file, so the rules are written once.

The model (hours are numbered 1 to 24; ``schedule[h - 1]`` is the action of hour h, the hour
ending at h:00):

* The battery has a power limit ``P`` MW (a positive integer), an energy capacity
  ``E = P * duration`` MWh, a round-trip efficiency ``eta`` (0 < eta <= 1) and a starting charge
  ``S`` MWh (an integer in [0, E]) at the start of hour 1.
* The action ``a`` of an hour is an integer in [-P, P]:
  ``a > 0`` charges ``a`` MWh bought from the grid: the charge rises by ``a`` and the hour settles
  ``-a * price``; ``a < 0`` discharges ``|a|`` MWh of charge, of which ``|a| * eta`` MWh reach the
  grid and are sold: the charge falls by ``|a|`` and the hour settles ``+|a| * eta * price``;
  ``a = 0`` idles and settles 0.
* The charge must stay in [0, E] after every hour. Energy left at the end of the day is worth
  nothing. Prices may be negative (then charging earns money and selling costs money).
* The profit is the sum of the 24 settlements.

Exactness: prices are whole cents and eta whole hundredths, so every settlement is a whole number
of *units* of $0.0001 (cents times hundredths). Profits, the optimum and the comparisons between
them are integers; only the score is a float, and by construction the optimum scores exactly 1.0
and an idle day exactly 0.2.
"""

from __future__ import annotations

import dataclasses
from decimal import Decimal, InvalidOperation

HOURS = 24
UNITS_PER_DOLLAR = 10_000          # a unit is $0.0001: one cent times one hundredth of eta
IDLE_SCORE = 0.2


class InvalidSchedule(ValueError):
    """A schedule that breaks a rule. ``hour`` is the hour (1-24) at fault, None for the whole list."""

    def __init__(self, message: str, hour: int | None = None):
        super().__init__(message)
        self.hour = hour


# ------------------------------------------------------------------ the battery and the day

@dataclasses.dataclass(frozen=True)
class Battery:
    power_mw: int            # P: the most MWh charged or discharged in one hour
    duration_h: int          # E / P
    efficiency: float        # eta, round trip, in whole hundredths
    initial_charge_mwh: int  # S: the charge at the start of hour 1

    @property
    def capacity_mwh(self) -> int:
        return self.power_mw * self.duration_h

    @property
    def eta_pct(self) -> int:
        return _hundredths(self.efficiency)

    def as_dict(self) -> dict:
        return {"power_mw": self.power_mw, "duration_h": self.duration_h,
                "capacity_mwh": self.capacity_mwh, "round_trip_efficiency": self.efficiency,
                "initial_charge_mwh": self.initial_charge_mwh}

    @classmethod
    def from_dict(cls, raw: dict) -> Battery:
        """A battery from its JSON form (as in the task), checked; ValueError says what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError("battery must be an object with power_mw, duration_h, "
                             "round_trip_efficiency and initial_charge_mwh")
        for key in ("power_mw", "duration_h", "initial_charge_mwh"):
            value = raw.get(key)
            if not _is_int(value):
                raise ValueError(f"battery.{key} must be an integer, not {value!r}")
        eta = raw.get("round_trip_efficiency")
        if not isinstance(eta, (int, float)) or isinstance(eta, bool):
            raise ValueError(f"battery.round_trip_efficiency must be a number, not {eta!r}")
        battery = cls(raw["power_mw"], raw["duration_h"], float(eta), raw["initial_charge_mwh"])
        battery.check()
        if "capacity_mwh" in raw and raw["capacity_mwh"] != battery.capacity_mwh:
            raise ValueError(f"battery.capacity_mwh is {raw['capacity_mwh']!r}, but power_mw x "
                             f"duration_h is {battery.capacity_mwh}")
        return battery

    def check(self) -> None:
        if self.power_mw < 1:
            raise ValueError(f"the power limit must be at least 1 MW, not {self.power_mw}")
        if self.duration_h < 1:
            raise ValueError(f"the duration must be at least 1 hour, not {self.duration_h}")
        pct = _hundredths(self.efficiency)          # raises on a non-hundredth
        if not 0 < pct <= 100:
            raise ValueError(f"the round-trip efficiency must be in (0, 1], not {self.efficiency}")
        if not 0 <= self.initial_charge_mwh <= self.capacity_mwh:
            raise ValueError(f"the starting charge {self.initial_charge_mwh} MWh is outside "
                             f"[0, {self.capacity_mwh}] MWh")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hundredths(eta: float) -> int:
    try:
        scaled = Decimal(str(eta)) * 100
    except InvalidOperation:
        raise ValueError(f"the round-trip efficiency {eta!r} is not a number") from None
    if scaled != scaled.to_integral_value():
        raise ValueError(f"the round-trip efficiency {eta!r} must be given in whole hundredths "
                         "(such as 0.85)")
    return int(scaled)


def price_cents(price: float) -> int:
    """A price in $/MWh as whole cents; ValueError for a price finer than a cent."""
    if not isinstance(price, (int, float)) or isinstance(price, bool):
        raise ValueError(f"a price must be a number, not {price!r}")
    try:
        scaled = Decimal(str(price)) * 100
    except InvalidOperation:
        raise ValueError(f"the price {price!r} is not a number") from None
    if not scaled.is_finite() or scaled != scaled.to_integral_value():
        raise ValueError(f"the price {price!r} must be given in whole cents (such as 23.45)")
    return int(scaled)


def prices_cents(prices: list) -> list[int]:
    if not isinstance(prices, list) or len(prices) != HOURS:
        raise ValueError(f"prices must be a list of {HOURS} numbers, hour 1 first")
    out = []
    for hour, price in enumerate(prices, 1):
        try:
            out.append(price_cents(price))
        except ValueError as exc:
            raise ValueError(f"hour {hour}: {exc}") from None
    return out


def dollars(units: int) -> str:
    """An amount in units written exactly in dollars, such as -12345 -> '-$1.2345'."""
    sign = "-" if units < 0 else ""
    whole, frac = divmod(abs(units), UNITS_PER_DOLLAR)
    return f"{sign}${whole:,}.{frac:04d}"


def to_float(units: int) -> float:
    return units / UNITS_PER_DOLLAR


# ------------------------------------------------------------------ settlement and validation

def settlement(action: int, cents: int, eta_pct: int) -> int:
    """One hour's settlement in units: buying ``action`` MWh, or selling ``|action| * eta`` MWh."""
    if action > 0:
        return -action * cents * 100
    return -action * eta_pct * cents


def validate(schedule: object, battery: Battery) -> list[int]:
    """The schedule as a list of 24 ints, or InvalidSchedule naming the first hour at fault and why."""
    if not isinstance(schedule, list):
        raise InvalidSchedule(f"the schedule must be a JSON array of {HOURS} integers (one action per "
                              f"hour, hour 1 first), not {type(schedule).__name__}")
    if len(schedule) != HOURS:
        raise InvalidSchedule(f"the schedule has {len(schedule)} actions; it needs exactly {HOURS}, "
                              f"one per hour from hour 1 to hour {HOURS}")
    p, e = battery.power_mw, battery.capacity_mwh
    charge = battery.initial_charge_mwh
    for hour, action in enumerate(schedule, 1):
        at = f"hour {hour} (schedule[{hour - 1}])"
        if not _is_int(action):
            raise InvalidSchedule(f"{at}: the action {action!r} is not an integer; every action is a "
                                  f"whole number of MWh from {-p} to {p}", hour)
        if not -p <= action <= p:
            raise InvalidSchedule(f"{at}: the action {action} breaks the power limit: with P = {p} MW "
                                  f"an action is from {-p} to {p} (charge before the hour: "
                                  f"{charge} MWh)", hour)
        after = charge + action
        if after > e:
            raise InvalidSchedule(f"{at}: the action {action} charges {action} MWh with {charge} MWh "
                                  f"already charged before the hour, which would take the charge to "
                                  f"{after} MWh, above the capacity E = {e} MWh; charge at most "
                                  f"{min(p, e - charge)} MWh this hour", hour)
        if after < 0:
            raise InvalidSchedule(f"{at}: the action {action} discharges {-action} MWh with only "
                                  f"{charge} MWh charged before the hour, which would take the charge "
                                  f"to {after} MWh, below empty (0 MWh); discharge at most "
                                  f"{min(p, charge)} MWh this hour", hour)
        charge = after
    return list(schedule)


def charges(schedule: list[int], battery: Battery) -> list[int]:
    """The charge after each hour (the schedule must be valid)."""
    out, charge = [], battery.initial_charge_mwh
    for action in schedule:
        charge += action
        out.append(charge)
    return out


def profit(schedule: list[int], cents: list[int], battery: Battery) -> int:
    """The profit of a valid schedule, in units ($0.0001)."""
    eta = battery.eta_pct
    return sum(settlement(a, c, eta) for a, c in zip(schedule, cents))


# ------------------------------------------------------------------ the exact optimum

def optimum(cents: list[int], battery: Battery) -> tuple[int, list[int]]:
    """The best profit (units) any valid schedule makes, and one schedule that makes it.

    Dynamic programming over the charge (an integer in [0, E]) hour by hour: ``best[c]`` is the
    best profit of the hours so far that ends them with charge ``c``. Every action in [-P, P] that
    keeps the charge in [0, E] is tried, so the result is exact for the discrete actions.
    """
    p, e, eta = battery.power_mw, battery.capacity_mwh, battery.eta_pct
    none = None
    best: list[int | None] = [none] * (e + 1)
    best[battery.initial_charge_mwh] = 0
    came_from: list[list[int]] = []
    for cent in cents:
        gain = {a: settlement(a, cent, eta) for a in range(-p, p + 1)}
        new: list[int | None] = [none] * (e + 1)
        back = [0] * (e + 1)
        for c, value in enumerate(best):
            if value is None:
                continue
            for a in range(max(-p, -c), min(p, e - c) + 1):
                v = value + gain[a]
                nc = c + a
                if new[nc] is None or v > new[nc]:
                    new[nc], back[nc] = v, a
        best = new
        came_from.append(back)
    end = max((c for c in range(e + 1) if best[c] is not None), key=lambda c: best[c])
    value = best[end]
    schedule = []
    c = end
    for back in reversed(came_from):
        a = back[c]
        schedule.append(a)
        c -= a
    schedule.reverse()
    assert c == battery.initial_charge_mwh
    return value, schedule


def optimum_profit(cents: list[int], battery: Battery) -> int:
    return optimum(cents, battery)[0]


# ------------------------------------------------------------------ grading

def score(profit_units: int | None, optimum_units: int) -> float:
    """The score of a day, from the profit of the last valid schedule (None: none was submitted).

    * no valid schedule: 0.0
    * profit p >= 0: 0.2 + 0.8 * p / O, so idling (p = 0) scores exactly 0.2 and the optimum
      (p = O) exactly 1.0
    * a loss (p < 0): max(0, 0.2 * (1 + p / O)), below 0.2, falling linearly to 0 at a loss as
      large as the optimum's profit
    where O > 0 is the optimum profit. A day with O = 0 (the generator ships none) scores 1.0 for
    p = 0 and 0.0 for a loss.
    """
    if profit_units is None:
        return 0.0
    p, o = int(profit_units), int(optimum_units)
    if o <= 0:
        return 1.0 if p >= o else 0.0
    if p >= o:
        return 1.0
    if p == 0:
        return IDLE_SCORE
    if p > 0:
        return IDLE_SCORE + (1 - IDLE_SCORE) * p / o
    return max(0.0, IDLE_SCORE * (1 + p / o))
