"""Offline, reproducible training-prompt mix for the drafter.

DSpark trains the drafter on the target's own responses to a broad instruction mix (chat 18 %,
math 39 %, code 39 %, instruction following 4 %). No dataset hub is reachable here, so the
prompts are built from text every CPython 3.11 install carries plus seeded templates:

* code — names, signatures, docstring summaries and short source excerpts (≤ 30 lines) of a
  fixed list of stdlib modules, asked about in many ways, plus parameterised programming tasks;
* math — seeded word problems, arithmetic, algebra, sequences, probability and geometry;
* chat — prose paragraphs from ``pydoc_data.topics`` (the language reference) and stdlib module
  docstrings, plus open questions built from topic lists;
* instruction — format constraints (bullets, JSON, word limits, poems, …) on chat questions;
* stub — a typed signature and a docstring with worked examples, the body left to write (the
  shape of HumanEval-style completion tasks); the examples are computed by a reference solution;
* task — multi-part assistant requests: writing with constraints, role-play, reasoning puzzles,
  extraction from a given text, explanations that connect two ideas (``task_v2`` is the same
  with two wording glitches fixed; ``task`` stays as it was so that existing caches reproduce);
* longform — posts, stories, letters, essays and reports of several paragraphs, with a length
  or a structure asked for.

``MIX`` is the paper's split over the first four; ``MIXES["formats"]`` adds stubs and tasks, which
the paper mix lacks, and ``MIXES["writing"]`` long-form writing (``TrainConfig.data_mix`` picks
a mix per data seed). A generator's output for a seed never changes once a cache was built
from it: a fix is a new domain version.

Nothing is read from outside the standard library, so the same seed gives the same prompts on
any machine with the same Python 3.11 patch release (docstrings change rarely even across patch
releases; ``python -OO`` strips docstrings and would shrink the code and chat pools, so
:func:`build_prompts` refuses to run under it).

The set must never overlap the evaluation benchmarks: :func:`check_no_overlap` flags exact
matches and shared 12-word spans, and :func:`check_against_benchmarks` is what a training
pipeline calls on the built set before generating responses.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import importlib
import inspect
import io
import json
import math
import random
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

MIX: dict[str, float] = {"chat": 0.18, "math": 0.39, "code": 0.39, "instruction": 0.04}

BOXED = "Please reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_PREFIX = (
    "Write a solution to the following problem and make sure that it passes the tests:"
)
# Instructions shared with the benchmarks on purpose (they match the eval prompt format);
# they are removed before comparing, so they alone never count as overlap.
BOILERPLATE: tuple[str, ...] = (BOXED, HUMANEVAL_PREFIX)
SHINGLE_WORDS = 12
# Benchmark prompts shorter than this are matched exactly, not as a span (a two-word span would
# flag unrelated prompts).
MIN_SPAN_WORDS = 3


@dataclass(frozen=True)
class TrainingPrompt:
    id: str
    domain: str
    text: str


# --------------------------------------------------------------------------------------------
# Shared vocabulary
# --------------------------------------------------------------------------------------------

_PEOPLE = (
    ("Amara", "she"), ("Bilal", "he"), ("Chen", "he"), ("Dalia", "she"), ("Emeka", "he"),
    ("Farah", "she"), ("Gustavo", "he"), ("Hana", "she"), ("Ivan", "he"), ("Jasmine", "she"),
    ("Kofi", "he"), ("Leila", "she"), ("Mateo", "he"), ("Nadia", "she"), ("Oskar", "he"),
    ("Priya", "she"), ("Quentin", "he"), ("Rosa", "she"), ("Sanjay", "he"), ("Tamsin", "she"),
    ("Umar", "he"), ("Valentina", "she"), ("Wei", "he"), ("Ximena", "she"), ("Yusuf", "he"),
    ("Zofia", "she"), ("Arjun", "he"), ("Beatriz", "she"), ("Callum", "he"), ("Dmitri", "he"),
    ("Elif", "she"), ("Fiona", "she"), ("Goran", "he"), ("Ingrid", "she"), ("Jamal", "he"),
    ("Keiko", "she"), ("Lorenzo", "he"), ("Maya", "she"), ("Niall", "he"), ("Olga", "she"),
    ("Pedro", "he"), ("Ravi", "he"), ("Sofia", "she"), ("Tariq", "he"), ("Uma", "she"),
    ("Viktor", "he"), ("Wanjiru", "she"), ("Yara", "she"), ("Zane", "he"), ("Aiko", "she"),
)
_POSSESSIVE = {"she": "her", "he": "his"}

# (plural noun, min price, max price) in dollars.
_GOODS = (
    ("notebooks", 2, 7), ("pencils", 1, 3), ("apples", 1, 2), ("mangoes", 1, 4),
    ("loaves of bread", 2, 6), ("bags of rice", 4, 15), ("tickets", 8, 40), ("T-shirts", 6, 25),
    ("plant pots", 3, 12), ("candles", 2, 9), ("comic books", 3, 10), ("bottles of juice", 1, 5),
    ("packs of stickers", 1, 4), ("jars of honey", 5, 14), ("bunches of flowers", 4, 18),
    ("boxes of tea", 3, 11), ("puzzle sets", 9, 30), ("paintbrushes", 2, 8), ("tennis balls", 1, 3),
    ("cupcakes", 2, 5), ("scarves", 7, 22), ("board games", 15, 45), ("USB cables", 4, 12),
)
_CONTAINERS = (("box", "boxes"), ("crate", "crates"), ("basket", "baskets"), ("carton", "cartons"),
               ("tray", "trays"), ("bin", "bins"), ("sack", "sacks"))
_THINGS = ("jacket", "lamp", "bicycle", "kettle", "backpack", "monitor", "sofa", "watch", "tent",
           "printer", "blender", "pair of boots")
_VEHICLES = ("cyclist", "train", "bus", "delivery van", "ferry", "runner", "truck", "scooter")
_JOBS = ("painting a fence", "sorting the mail", "cleaning the pool", "filling the tank",
         "assembling the shelves", "mowing the field", "typing the report", "packing the orders")
_COLOURS = ("red", "blue", "green", "yellow", "white", "black", "purple", "orange")
_SPORTS = ("football", "chess", "swimming", "basketball", "tennis", "volleyball", "cricket")
_INGREDIENTS = ("flour", "sugar", "milk", "oats", "rice", "lentils", "butter", "yogurt")


def _person(rng: random.Random) -> tuple[str, str]:
    return rng.choice(_PEOPLE)


def _two_people(rng: random.Random) -> tuple[tuple[str, str], tuple[str, str]]:
    a, b = rng.sample(_PEOPLE, 2)
    return a, b


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiouAEIOU" else "a ") + noun


def _money(value: float) -> str:
    return f"${value:.2f}" if value != int(value) else f"${int(value)}"


def _price(rng: random.Random, lo: int, hi: int) -> float:
    return rng.randint(lo, hi) + rng.choice((0, 0, 0.25, 0.5, 0.75))


# --------------------------------------------------------------------------------------------
# Math: seeded problem generators (numbers are built backwards so answers stay clean)
# --------------------------------------------------------------------------------------------


def _m_shopping(rng):
    (n, p), ((g1, lo1, hi1), (g2, lo2, hi2)) = _person(rng), rng.sample(_GOODS, 2)
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    q = rng.choice(("How much does {p} spend altogether?", "What is the total cost?",
                    "How much money does {p} pay in total?"))
    return (f"{n} buys {a} {g1} at {_money(_price(rng, lo1, hi1))} each and {b} {g2} at "
            f"{_money(_price(rng, lo2, hi2))} each. " + q.format(p=p))


def _m_change(rng):
    (n, p), (g, lo, hi) = _person(rng), rng.choice(_GOODS)
    k, price = rng.randint(2, 8), rng.randint(lo, hi)
    bill = rng.choice([b for b in (20, 50, 100, 200) if b > k * price] or [500])
    return (f"{n} wants {k} {g} that cost {_money(price)} each and hands the cashier a "
            f"{_money(bill)} note. How much change should {p} get back?")


def _m_discount(rng):
    g = rng.choice(_THINGS)
    price, off = rng.randint(20, 400), rng.choice((10, 15, 20, 25, 30, 40, 50))
    extra = rng.choice(("", f" A further {rng.choice((5, 10))}% is taken off the reduced price at the till."))
    return f"A {g} normally costs {_money(price)}. This week it is {off}% off.{extra} What does it cost now?"


def _m_tip(rng):
    n, _ = _person(rng)
    bill, tip, people = rng.randint(24, 180), rng.choice((10, 12, 15, 18, 20)), rng.randint(2, 6)
    return (f"{n} and {people - 1} friends have dinner and the bill comes to {_money(bill)}. They add a tip "
            f"of {tip}% and split the total equally. How much does each person pay?")


def _m_wages(rng):
    n, p = _person(rng)
    h, d, r, w = rng.randint(3, 9), rng.randint(3, 6), rng.randint(9, 30), rng.randint(2, 8)
    bonus = rng.choice(("", f" At the end of the period {p} also receives a {_money(rng.randint(2, 20) * 10)} bonus."))
    return (f"{n} works {h} hours a day, {d} days a week, earning {_money(r)} per hour.{bonus} "
            f"How much does {p} earn in {w} weeks?")


def _m_savings(rng):
    (n, p), item = _person(rng), rng.choice(("laptop", "guitar", "telescope", "camera", "bike", "phone"))
    cost, have, per = rng.randint(150, 1200), rng.randint(0, 100), rng.randint(10, 60)
    return (f"{n} is saving for a {item} that costs {_money(cost)}. {p.capitalize()} already has "
            f"{_money(have)} and puts away {_money(per)} every week. After how many weeks will "
            f"{p} have enough money?")


def _m_speed(rng):
    v = rng.choice(_VEHICLES)
    s1, t1, s2, t2 = rng.randint(8, 90), rng.randint(1, 5), rng.randint(8, 90), rng.randint(1, 4)
    q = rng.choice(("What is the total distance covered?", "What is the average speed for the whole journey?"))
    return f"A {v} travels at {s1} km/h for {t1} hours and then at {s2} km/h for {t2} hours. {q}"


def _m_meeting(rng):
    (a, _), (b, _) = _two_people(rng)
    va, vb, t = rng.randint(3, 20), rng.randint(3, 20), rng.randint(1, 6)
    return (f"{a} and {b} start at opposite ends of a trail {(va + vb) * t} km long and walk towards "
            f"each other, {a} at {va} km/h and {b} at {vb} km/h. After how many hours do they meet?")


def _m_work(rng):
    (a, _), (b, _) = _two_people(rng)
    x, y = rng.sample((2, 3, 4, 5, 6, 8, 10, 12, 15), 2)
    return f"{a} can finish {rng.choice(_JOBS)} in {x} hours and {b} can do it in {y} hours. How long does it take if they work together?"


def _m_ages(rng):
    (a, _), (b, _) = _two_people(rng)
    young, k, years = rng.randint(3, 20), rng.randint(2, 4), rng.randint(2, 10)
    total = young * (k + 1) + 2 * years
    return (f"{a}'s age is {k} times {b}'s age today. {years} years from today their ages will "
            f"add up to {total}. What is {b}'s age today?")


def _m_ratio(rng):
    (a, _), (b, _) = _two_people(rng)
    x, y = rng.sample(range(1, 10), 2)
    total = (x + y) * rng.randint(5, 60)
    return f"{a} and {b} share {_money(total)} in the ratio {x}:{y}. How much more does the larger share get?"


def _m_percent_change(rng):
    thing = rng.choice(("population of a village", "price of a train ticket", "number of club members",
                        "monthly rent", "number of visitors to a museum", "yield of an orchard"))
    old = rng.randint(4, 90) * 10
    new = old + old * rng.choice((-30, -25, -20, -10, 5, 10, 15, 20, 40, 50)) // 100
    return f"The {thing} changed from {old} to {new}. What was the percentage change?"


def _m_interest(rng):
    n, p = _person(rng)
    principal, rate, years = rng.randint(5, 80) * 100, rng.choice((2, 3, 4, 5, 6, 8)), rng.randint(2, 6)
    kind = rng.choice(("simple", "compound (once a year)"))
    return (f"{n} deposits {_money(principal)} in an account paying {rate}% {kind} interest. "
            f"How much will be in the account after {years} years?")


def _m_rectangle(rng):
    w, h = rng.randint(3, 40), rng.randint(3, 40)
    what = rng.choice(("garden", "classroom floor", "swimming pool", "car park", "rug", "field"))
    q = rng.choice((
        "What is its area?",
        "What is its perimeter?",
        f"A path {rng.randint(1, 3)} m wide is built all the way around it. What is the area of the path?",
        f"Tiles cost {_money(rng.randint(3, 30))} per square metre. How much does it cost to tile it?",
    ))
    return f"A rectangular {what} is {w} m long and {h} m wide. {q}"


def _m_circle(rng):
    r = rng.randint(2, 30)
    q = rng.choice(("Find its area", "Find its circumference", "Find the area of the sector with a "
                    f"{rng.choice((30, 45, 60, 90, 120))} degree angle"))
    tail = rng.choice((" in terms of $\\pi$.", ", using 3.14 for pi.", " to two decimal places."))
    return f"A circle has radius {r} cm. {q}{tail}"


def _m_pythagoras(rng):
    a, b, c = rng.choice(((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29), (9, 40, 41)))
    k = rng.randint(1, 4)
    return (f"A ladder {c * k} feet long leans against a wall with its foot {a * k} feet from the "
            f"base of the wall. How high up the wall does the ladder reach?")


def _m_average(rng):
    n, p = _person(rng)
    scores = [rng.randint(55, 98) for _ in range(rng.randint(3, 6))]
    target = min(99, sum(scores) // len(scores) + rng.randint(1, 6))
    return (f"{n} scored {', '.join(map(str, scores[:-1]))} and {scores[-1]} on {_POSSESSIVE[p]} "
            f"first {len(scores)} tests. What must {p} score on the next test to bring the average "
            f"to {target}?")


def _m_recipe(rng):
    s, t = rng.sample((2, 3, 4, 6, 8, 10, 12), 2)
    q = Fraction(rng.randint(1, 12), rng.choice((1, 2, 3, 4)))
    return (f"A recipe for {s} servings uses {q} cups of {rng.choice(_INGREDIENTS)}. How many cups "
            f"are needed for {t} servings?")


def _m_inventory(rng):
    g = rng.choice(_GOODS)[0]
    start, mon = rng.randint(150, 900), rng.randint(10, 60)
    mult, recv = rng.randint(2, 3), rng.randint(20, 120)
    return (f"A shop starts the week with {start} {g}. It sells {mon} on Monday, {mult} times as "
            f"many on Tuesday, and receives a delivery of {recv} on Wednesday. How many {g} are "
            "in stock on Wednesday evening?")


def _m_packing(rng):
    g, (c, cs) = rng.choice(_GOODS)[0], rng.choice(_CONTAINERS)
    per, total = rng.randint(4, 24), rng.randint(50, 1000)
    return (f"Each {c} holds {per} {g}. How many {cs} are needed to pack {total} {g}, and how "
            "many spaces are left in the last one?")


def _m_fraction_ops(rng):
    a, b = Fraction(rng.randint(1, 9), rng.randint(2, 12)), Fraction(rng.randint(1, 9), rng.randint(2, 12))
    op = rng.choice(("+", "-", "\\times", "\\div"))
    return f"Compute $\\frac{{{a.numerator}}}{{{a.denominator}}} {op} \\frac{{{b.numerator}}}{{{b.denominator}}}$ and write the answer in lowest terms."


def _m_fraction_of(rng):
    n, p = _person(rng)
    total, f1, f2 = rng.randint(2, 30) * 12, Fraction(1, rng.choice((2, 3, 4))), Fraction(1, rng.choice((3, 4, 6)))
    return (f"{n} has {total} stamps. {p.capitalize()} gives {f1} of them to a cousin and then "
            f"sells {f2} of what is left. How many stamps does {p} keep?")


def _m_linear(rng):
    x, a, b = rng.randint(-15, 20), rng.randint(2, 12), rng.randint(-30, 30)
    c = a * x + b
    sign = "+" if b >= 0 else "-"
    var = rng.choice("xyznk")
    return rng.choice((f"Solve for ${var}$: ${a}{var} {sign} {abs(b)} = {c}$.",
                       f"Solve {a}{var} {sign} {abs(b)} = {c} for {var}."))


def _m_system(rng):
    x, y = rng.randint(-9, 12), rng.randint(-9, 12)
    a, b, c, d = (rng.randint(2, 9) for _ in range(4))  # determinant -(ad + bc) is never 0
    return f"Solve the system of equations ${a}x + {b}y = {a * x + b * y}$ and ${c}x - {d}y = {c * x - d * y}$."


def _poly(coeffs: Sequence[int], var: str = "x") -> str:
    """LaTeX for a polynomial given highest-degree-first integer coefficients."""
    terms = []
    for power, c in zip(range(len(coeffs) - 1, -1, -1), coeffs):
        if c == 0:
            continue
        mag = "" if abs(c) == 1 and power else str(abs(c))
        body = mag + (var if power else "") + (f"^{power}" if power > 1 else "")
        terms.append(("-" if c < 0 else "+", body))
    if not terms:
        return "0"
    sign, body = terms[0]
    return ("-" if sign == "-" else "") + body + "".join(f" {s} {b}" for s, b in terms[1:])


def _m_quadratic(rng):
    r1, r2 = rng.randint(-12, 12), rng.randint(-12, 12)
    eq = f"${_poly((1, -(r1 + r2), r1 * r2))} = 0$"
    return rng.choice((f"Find all real solutions of {eq}.", f"Factor and solve {eq}.",
                       f"What is the sum of the roots of {eq}?",
                       f"What is the product of the solutions of {eq}?"))


def _m_function_eval(rng):
    a, b, c, v = rng.randint(-5, 6), rng.randint(-9, 9), rng.randint(-20, 20), rng.randint(-6, 6)
    g = rng.randint(1, 5)
    q = rng.choice((f"what is $f({v})$?", f"what is $f(f({g}))$?", f"for which $x$ is $f(x) = {c}$?"))
    return f"If $f(x) = {_poly((a or 1, b, c))}$, {q}"


def _m_slope(rng):
    x1, y1, x2, y2 = (rng.randint(-10, 10) for _ in range(4))
    x2 += x1 == x2
    q = rng.choice(("Find the slope of the line", "Find the equation of the line",
                    "Find the midpoint and the length of the segment"))
    return f"{q} through the points $({x1}, {y1})$ and $({x2}, {y2})$."


def _m_sequence(rng):
    a, d, n = rng.randint(-10, 30), rng.randint(-7, 12) or 3, rng.randint(10, 60)
    if rng.random() < 0.5:
        return f"An arithmetic sequence starts {a}, {a + d}, {a + 2 * d}, ... What is its {n}th term, and what is the sum of its first {n} terms?"
    r = rng.choice((2, 3, -2, 5))
    return f"A geometric sequence starts {a or 1}, {(a or 1) * r}, {(a or 1) * r * r}, ... What is its {rng.randint(6, 12)}th term?"


def _m_probability(rng):
    counts = dict(zip(rng.sample(_COLOURS, 3), (rng.randint(2, 12) for _ in range(3))))
    bag = ", ".join(f"{v} {k}" for k, v in counts.items())
    c1, c2 = rng.sample(list(counts), 2)
    q = rng.choice((f"what is the probability that it is {c1}?",
                    f"two marbles are drawn without replacement. What is the probability that the first is {c1} and the second is {c2}?",
                    f"what is the probability that it is not {c2}?"))
    return f"A bag contains {bag} marbles. If a marble is picked at random, {q}"


def _m_counting(rng):
    n, k = rng.randint(5, 12), rng.randint(2, 4)
    return rng.choice((
        f"In how many ways can {n} different books be arranged on a shelf if two particular books must be next to each other?",
        f"A committee of {k} is chosen from {n} people. How many different committees are possible?",
        f"How many {k}-digit numbers can be formed from the digits 1 to {min(n, 9)} if no digit repeats?",
        f"In how many ways can {k} prizes (gold, silver, bronze, ...) be awarded among {n} runners?",
    ))


def _m_number_theory(rng):
    a, b = rng.randint(100, 99999), rng.randint(3, 97)
    return rng.choice((
        f"What is the remainder when {a} is divided by {b}?",
        f"What is the sum of all positive multiples of {b} that are less than {a}?",
        f"How many positive divisors does {rng.randint(2, 60) * rng.randint(2, 60)} have?",
        f"What is the greatest common divisor of {a} and {b * rng.randint(2, 400)}?",
        f"What is the least common multiple of {rng.randint(4, 40)}, {rng.randint(4, 40)} and {rng.randint(4, 40)}?",
        f"Write {a} in base {rng.choice((2, 3, 5, 7, 8, 16))}.",
    ))


def _m_schedule(rng):
    a, b = rng.sample((6, 8, 9, 10, 12, 15, 18, 20, 24, 25, 30), 2)
    h, m = rng.randint(5, 9), rng.choice((0, 15, 30, 45))
    return (f"One bus leaves the station every {a} minutes and another every {b} minutes. Both leave "
            f"together at {h}:{m:02d} a.m. When do they next leave together?")


def _m_time(rng):
    h1, m1 = rng.randint(5, 14), rng.randint(0, 59)
    dur = rng.randint(35, 600)
    what = rng.choice(("train journey", "flight", "hike", "film marathon", "workshop"))
    return f"A {what} starts at {h1}:{m1:02d} and lasts {dur} minutes. At what time does it end?"


def _m_units(rng):
    return rng.choice((
        f"How many seconds are there in {rng.randint(2, 30)} hours and {rng.randint(1, 59)} minutes?",
        f"Convert {rng.randint(1, 200) * 5} degrees Fahrenheit to Celsius.",
        f"A tank holds {rng.randint(12, 900)} litres. How many millilitres is that, and how many {rng.randint(2, 9)}-litre buckets fill it?",
        f"A car uses {rng.randint(4, 12)} litres of fuel per 100 km. How much fuel does it need for {rng.randint(30, 900)} km?",
        f"A map has a scale of 1:{rng.choice((25000, 50000, 100000, 200000))}. Two towns are {rng.randint(2, 40)} cm apart on the map. How far apart are they in kilometres?",
    ))


def _m_class_survey(rng):
    n = rng.randint(2, 9) * 20
    s1, s2 = rng.sample(_SPORTS, 2)
    p1, p2, both = rng.randint(30, 70), rng.randint(20, 60), rng.randint(5, 20)
    return (f"In a school of {n} students, {p1}% play {s1}, {p2}% play {s2} and {both}% play "
            f"both. How many students play neither?")


def _m_expression(rng):
    a, b, c, d, e = (rng.randint(2, 25) for _ in range(5))
    return rng.choice((
        f"Evaluate ${a} \\times ({b} + {c}) - {d}^2 \\div {e}$.",
        f"What is ${a}^3 - {b} \\cdot {c} + {d}$?",
        f"Simplify $\\sqrt{{{a * a * b}}}$.",
        f"Compute $({a} - {b})({c} + {d}) - {e}$.",
    ))


_MATH: tuple[Callable[[random.Random], str], ...] = (
    _m_shopping, _m_change, _m_discount, _m_tip, _m_wages, _m_savings, _m_speed, _m_meeting,
    _m_work, _m_ages, _m_ratio, _m_percent_change, _m_interest, _m_rectangle, _m_circle,
    _m_pythagoras, _m_average, _m_recipe, _m_inventory, _m_packing, _m_fraction_ops,
    _m_fraction_of, _m_linear, _m_system, _m_quadratic, _m_function_eval, _m_slope, _m_sequence,
    _m_probability, _m_counting, _m_number_theory, _m_schedule, _m_time, _m_units,
    _m_class_survey, _m_expression,
)


def _math_prompt(rng: random.Random) -> str:
    text = rng.choice(_MATH)(rng)
    r = rng.random()
    if r < 0.5:  # the format of the GSM8K / MATH500 eval prompts
        return f"{text}\n{BOXED}"
    if r < 0.65:
        return f"{text} Show your work."
    return text


# --------------------------------------------------------------------------------------------
# Code: the stdlib API catalogue and parameterised programming tasks
# --------------------------------------------------------------------------------------------

_CODE_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmath", "collections", "colorsys",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "difflib",
    "email.utils", "enum", "filecmp", "fnmatch", "fractions", "functools", "getopt", "gettext",
    "glob", "graphlib", "heapq", "html", "http.cookies", "inspect", "ipaddress", "itertools",
    "json", "keyword", "linecache", "locale", "logging", "math", "mimetypes", "netrc", "numbers",
    "operator", "optparse", "pathlib", "platform", "plistlib", "posixpath", "pprint", "queue",
    "quopri", "random", "re", "reprlib", "sched", "secrets", "shlex", "shutil", "statistics",
    "string", "struct", "tempfile", "textwrap", "timeit", "tokenize", "tomllib", "traceback",
    "types", "unicodedata", "urllib.parse", "uuid", "warnings", "weakref",
    "xml.etree.ElementTree", "zipfile", "zoneinfo",
)
_MAX_EXCERPT_LINES = 30


@dataclass(frozen=True)
class _Api:
    module: str
    name: str  # qualified: "Counter.most_common" for methods
    kind: str  # "function" | "method" | "class"
    signature: str
    summary: str
    source: str | None  # dedented source when it has at most _MAX_EXCERPT_LINES lines


def _summary(doc: str | None) -> str | None:
    """First sentence of the first prose paragraph (skipping builtins' "name(args)" lines)."""
    if not doc:
        return None
    for para in inspect.cleandoc(doc).split("\n\n"):
        text = " ".join(para.split())
        if re.fullmatch(r"[\w.]+\(.*\)( -> .*)?", text) or len(text.split()) < 3:
            continue
        text = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text)[0]
        return text if len(text) <= 240 else None
    return None


def _signature(obj, drop_self: bool = False) -> str | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    if drop_self:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    text = str(sig)
    # Object reprs carry memory addresses and set reprs depend on PYTHONHASHSEED: both would
    # make the prompts differ between runs.
    if " at 0x" in text or "{" in text or "<" in text or len(text) > 120:
        return None
    return text


def _source(obj) -> str | None:
    if not inspect.isfunction(obj):
        return None
    try:
        lines = textwrap.dedent(inspect.getsource(obj)).rstrip().splitlines()
    except (OSError, TypeError):
        return None
    return "\n".join(lines) if len(lines) <= _MAX_EXCERPT_LINES else None


def _own_doc(obj) -> str | None:
    return obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__


@functools.lru_cache(maxsize=1)
def _api_catalogue() -> tuple[_Api, ...]:
    """Public functions, classes and methods of `_CODE_MODULES` that have a usable docstring."""
    out = []
    for mod_name in _CODE_MODULES:
        module = importlib.import_module(mod_name)
        owners = {mod_name, "_" + mod_name.rsplit(".", 1)[-1]}
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) not in owners:
                continue
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            kind = "class" if inspect.isclass(obj) else "function"
            summary, sig = _summary(_own_doc(obj)), _signature(obj)
            if summary and sig:
                out.append(_Api(mod_name, name, kind, sig, summary, _source(obj)))
            if kind != "class":
                continue
            for meth_name, meth in sorted(vars(obj).items()):
                if meth_name.startswith("_") or not inspect.isfunction(meth):
                    continue
                summary, sig = _summary(meth.__doc__), _signature(meth, drop_self=True)
                if summary and sig:
                    out.append(_Api(mod_name, f"{name}.{meth_name}", "method", sig, summary,
                                    _source(meth)))
    return tuple(out)


_LANGUAGES = ("JavaScript", "TypeScript", "Go", "Rust", "C", "Java", "C#", "Kotlin", "Ruby", "Lua")

# Templates per kind of stdlib object; "api" ones fit functions and methods alike.
_API_TEMPLATES = (
    "Write pytest unit tests for `{module}.{name}{sig}`, which is documented as: \"{summary}\"",
    "Show a short, runnable example that uses `{module}.{name}` and explain what it prints.",
    "What does `{module}.{name}` do in Python, and when would I use it?",
    "What edge cases should I think about when calling `{module}.{name}{sig}`?",
    "The docstring of `{module}.{name}` says: \"{summary}\" Explain this in plain words with an example.",
)
_FUNCTION_TEMPLATES = (
    "Write a Python function `{short}{sig}`. It should do the following: {summary}",
    "Implement `{short}{sig}` from scratch, without importing `{module}`. Specification: {summary}",
    HUMANEVAL_PREFIX + "\n```python\ndef {short}{sig}:\n    \"\"\" {summary}\n    \"\"\"\n```",
)
_METHOD_TEMPLATES = (
    "Write the method `{short}{sig}` for a class like `{module}.{owner}`. It should do the following: {summary}",
    "Implement `{owner}.{short}{sig}` yourself, as if `{module}` did not exist. Specification: {summary}",
)
_CLASS_TEMPLATES = (
    "Write a Python class `{name}` whose constructor is `{name}{sig}`. Description: {summary}",
    "Explain the purpose of the `{module}.{name}` class and show how to create and use one.",
    "When should I use `{module}.{name}` instead of writing my own class? Give an example.",
)
_SOURCE_TEMPLATES = (
    "Explain what this function from the `{module}` module does:\n```python\n{source}\n```",
    "Rewrite this function to be more readable, keeping its behaviour:\n```python\n{source}\n```",
    "Review this code and point out possible bugs or unhandled edge cases:\n```python\n{source}\n```",
    "Write unit tests for the following function:\n```python\n{source}\n```",
    "Translate this Python function into {language}:\n```python\n{source}\n```",
    "What is the time complexity of this function? Explain briefly.\n```python\n{source}\n```",
    "Add type hints to this function and describe each parameter:\n```python\n{source}\n```",
    "```python\n{source}\n```\nWalk through this code line by line for a beginner.",
)


def _api_prompt(rng: random.Random) -> str:
    api = rng.choice(_api_catalogue())
    if api.source and rng.random() < 0.4:
        template = rng.choice(_SOURCE_TEMPLATES)
    elif api.kind == "class":
        template = rng.choice(_CLASS_TEMPLATES)
    else:
        own = _FUNCTION_TEMPLATES if api.kind == "function" else _METHOD_TEMPLATES
        template = rng.choice(_API_TEMPLATES + own)
    owner, _, short = api.name.rpartition(".")
    return template.format(module=api.module, name=api.name, owner=owner, short=short,
                           sig=api.signature, summary=api.summary, source=api.source,
                           language=rng.choice(_LANGUAGES))


_ELEMENTS = ("integers", "floats", "strings", "words", "temperatures", "prices", "timestamps",
             "user names", "file sizes in bytes", "scores")


def _list_op(rng):
    k, t = rng.randint(2, 10), rng.randint(-5, 100)
    return rng.choice((
        ("top_k", f"the {k} largest values, largest first"),
        ("above", f"only the values greater than {t}, in their original order"),
        ("running_total", "the running total at each position"),
        ("dedupe", "the values with duplicates removed, keeping the first occurrence"),
        ("frequencies", "a dict mapping each value to how often it occurs"),
        ("second_smallest", "the second smallest distinct value, or None if there is none"),
        ("chunks", f"the list split into chunks of {k} (the last chunk may be shorter)"),
        ("rotate", f"the list rotated {k} places to the {rng.choice(('left', 'right'))}"),
        ("pairs_summing", f"all pairs of positions whose values add up to {t}"),
        ("longest_run", "the length of the longest run of equal adjacent values"),
        ("moving_average", f"the moving average over a window of {k}"),
        ("interleave", "the values from the first half and the second half interleaved"),
        ("majority", "the value that appears more than half the time, or None"),
        ("median", "the median without using the statistics module"),
        ("every_nth", f"every {k}th value starting from the {rng.choice(('first', 'second', 'last'))}"),
    ))


def _string_op(rng):
    c, k = rng.choice("aeiousxz,;-"), rng.randint(2, 12)
    return rng.choice((
        ("count_char", f"the number of times '{c}' appears, ignoring case"),
        ("is_palindrome", f"whether it is a palindrome, ignoring {rng.choice(('spaces', 'punctuation and case', 'case'))}"),
        ("truncate", f"the text cut to at most {k * 5} characters, ending with '...' when cut"),
        ("run_length", "its run-length encoding, e.g. 'aaab' -> 'a3b1'"),
        ("caesar", f"the text shifted by {k} letters (Caesar cipher), keeping case"),
        ("to_camel", "the snake_case identifier converted to camelCase"),
        ("to_snake", "the CamelCase identifier converted to snake_case"),
        ("word_lengths", "a dict from each word to its length"),
        ("longest_word", "the longest word (the first one on ties)"),
        ("strip_vowels", "the text with every vowel removed"),
        ("title_case", "the text in title case, except for small words like 'of' and 'the'"),
        ("first_unique", "the first character that occurs only once, or None"),
        ("wrap", f"the text wrapped into lines of at most {k * 6} characters"),
        ("is_anagram", "whether it is an anagram of a second string argument"),
        ("mask", f"the string with all but the last {min(k, 4)} characters replaced by '*'"),
    ))


def _number_op(rng):
    b, n = rng.choice((2, 3, 5, 7, 8, 16)), rng.randint(5, 50)
    return rng.choice((
        ("digit_sum", "the sum of the decimal digits of n"),
        ("is_prime", "whether n is prime, efficiently for n up to 10**9"),
        ("collatz_steps", "how many Collatz steps it takes n to reach 1"),
        ("to_base", f"the representation of n in base {b} as a string"),
        ("to_roman", "n written as a Roman numeral"),
        ("from_roman", "the integer value of a Roman numeral string"),
        ("nth_fibonacci", "the nth Fibonacci number in O(log n) time"),
        ("primes_below", f"all primes below n using a sieve (test it with n = {n})"),
        ("is_perfect", "whether n equals the sum of its proper divisors"),
        ("reverse_digits", "n with its digits reversed, keeping the sign"),
        ("factorial_mod", f"n! modulo {rng.choice((97, 1000, 10**9 + 7))}"),
        ("binary_ones", "the number of 1 bits in the binary form of n"),
        ("is_power", f"whether n is a power of {b}"),
    ))


def _code_task_lists(rng):
    fn, what = _list_op(rng)
    return f"Write a Python function `{fn}(values)` that takes a list of {rng.choice(_ELEMENTS)} and returns {what}."


def _code_task_strings(rng):
    fn, what = _string_op(rng)
    return rng.choice((f"Write a Python function `{fn}(text)` that takes a string and returns {what}.",
                       f"Implement `{fn}(text: str)` in Python. Given a string, it should return {what}. Include a docstring."))


def _code_task_numbers(rng):
    fn, what = _number_op(rng)
    extra = rng.choice(("", " Include a few doctest examples.", " Raise ValueError for negative input.",
                        " Add type hints and a docstring."))
    return f"Write a Python function `{fn}(n)` that returns {what}.{extra}"


def _code_task_other_language(rng):
    op, given = rng.choice(((_list_op, f"an array of {rng.choice(_ELEMENTS)}"), (_string_op, "a string"),
                            (_number_op, "an integer n")))
    return f"Write a {rng.choice(_LANGUAGES)} function that takes {given} and returns {op(rng)[1]}."


_DATE_FORMATS = (("%d/%m/%Y", "DD/MM/YYYY"), ("%Y-%m-%d", "YYYY-MM-DD"), ("%B %d, %Y", "Month D, YYYY"),
                 ("%d %b %Y", "D Mon YYYY"), ("%m-%d-%y", "MM-DD-YY"), ("%Y%m%d", "YYYYMMDD"))


def _code_task_dates(rng):
    import datetime

    fmt, label = rng.choice(_DATE_FORMATS)
    day = datetime.date(rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28))
    goal = rng.choice(("returns a `datetime.date`", "returns the weekday name",
                       "returns the number of days until that date from today",
                       "returns the date in ISO format", "returns None for invalid input instead of raising"))
    return f"Write a Python function that parses a date string such as '{day.strftime(fmt)}' ({label}) and {goal}."


_RECORDS = (
    ("orders", ("customer", "amount", "date")), ("employees", ("department", "salary", "name")),
    ("songs", ("artist", "duration_seconds", "title")), ("trips", ("city", "distance_km", "driver")),
    ("books", ("author", "pages", "year")), ("sensors", ("location", "reading", "timestamp")),
    ("students", ("class_name", "grade", "student_id")), ("tickets", ("priority", "hours_open", "owner")),
)


def _code_task_records(rng):
    table, (key, num, other) = rng.choice(_RECORDS)
    return rng.choice((
        f"Given a list of dicts for {table} with keys `{key}`, `{num}` and `{other}`, write a Python function that returns the total `{num}` per `{key}`.",
        f"Write a Python script that reads `{table}.csv` (columns: {key}, {num}, {other}) and prints the {rng.randint(2, 10)} rows with the highest {num}.",
        f"Write a SQL query that returns, for each {key} in the `{table}` table, the average {num} and the number of rows, sorted by the average.",
        f"Using pandas, load `{table}.csv` and compute the {rng.choice(('mean', 'median', 'maximum'))} `{num}` for each `{key}`.",
        f"Write a Python dataclass for a row of `{table}` ({key}, {num}, {other}) and a function that validates a list of them.",
    ))


_CLASSES = (
    ("BankAccount", "a bank account with deposit, withdraw (no overdraft) and a transaction history"),
    ("BoundedQueue", "a FIFO queue that holds at most {k} items and drops the oldest when full"),
    ("LRUCache", "a least-recently-used cache with capacity {k}"),
    ("Matrix", "a small matrix with addition, multiplication and transpose"),
    ("Inventory", "a shop inventory that tracks quantities and warns below {k} units"),
    ("RateLimiter", "a rate limiter that allows {k} calls per second"),
    ("Stopwatch", "a stopwatch with start, stop, lap and reset"),
    ("Polynomial", "a polynomial with evaluation, addition and derivative"),
    ("Graph", "an undirected graph with add_edge, neighbours and shortest_path (BFS)"),
    ("Fraction", "an exact fraction that always stays in lowest terms"),
    ("TodoList", "a to-do list with priorities from 1 to {k}"),
    ("Vector2D", "a 2D vector with length, dot product and rotation"),
)


def _code_task_class(rng):
    name, what = rng.choice(_CLASSES)
    extra = rng.choice(("", " Include type hints.", " Add a __repr__.", " Write a few tests for it.",
                        " Make it iterable."))
    return f"Write a Python class `{name}` that implements {what.format(k=rng.randint(2, 20))}.{extra}"


_ALGORITHMS = (
    "binary search", "merge sort", "quicksort", "heap sort", "insertion sort", "breadth-first search",
    "depth-first search", "Dijkstra's shortest path algorithm", "union-find with path compression",
    "a trie for prefix lookups", "the Knuth-Morris-Pratt string search", "topological sorting",
    "the longest common subsequence", "edit distance", "the 0/1 knapsack problem",
    "Kadane's maximum subarray", "a min-heap", "the sieve of Eratosthenes", "matrix exponentiation",
    "flood fill on a grid", "the N-queens problem", "a balanced parentheses checker",
    "reservoir sampling", "a sliding window maximum", "counting sort",
)


def _code_task_algorithm(rng):
    how = rng.choice(("", " iteratively", " recursively", " with type hints", " and explain its complexity",
                      " and test it on a small example"))
    lang = "Python" if rng.random() < 0.75 else rng.choice(_LANGUAGES)
    return f"Implement {rng.choice(_ALGORITHMS)} in {lang}{how}."


def _code_task_predict(rng):
    a, b, c, d = (rng.randint(1, 20) for _ in range(4))
    snippet = rng.choice((
        f"values = [{a}, {b}, {c}, {d}]\nprint([v * {a % 4 + 2} for v in values if v % 2 == {b % 2}])",
        f"total = 0\nfor i in range({a}, {a + b}):\n    if i % {c % 5 + 2} == 0:\n        total += i\nprint(total)",
        f"word = \"{rng.choice(('speculative', 'decoding', 'drafter', 'parallel', 'verification'))}\"\nprint(word[{a % 5}:{a % 5 + c % 6 + 1}], word[::-{b % 3 + 1}])",
        f"counts = {{}}\nfor ch in \"{rng.choice(('banana', 'mississippi', 'abracadabra', 'bookkeeper'))}\":\n    counts[ch] = counts.get(ch, 0) + 1\nprint(max(counts, key=counts.get), len(counts))",
        f"def f(n):\n    return n if n < {c % 4 + 2} else f(n - 1) + f(n - 2)\n\nprint(f({a % 10 + 3}))",
        f"x = [{a}, {b}]\ny = x\ny.append({c})\nprint(x, len(y) * {d})",
    ))
    return rng.choice(("What does this Python code print?", "Predict the output and explain why:",
                       "Trace this program and give its output:")) + f"\n```python\n{snippet}\n```"


def _code_task_bugfix(rng):
    name = rng.choice(("total", "acc", "result", "s"))
    n = rng.randint(3, 12)
    snippet = rng.choice((
        f"def average(xs):\n    {name} = 0\n    for i in range(1, len(xs)):\n        {name} += xs[i]\n    return {name} / len(xs)",
        f"def last_{n}(items):\n    return items[-{n}:-1]",
        f"def count_words(text):\n    {name} = {{}}\n    for w in text.split():\n        {name}[w] += 1\n    return {name}",
        f"def add_item(item, bucket=[]):\n    bucket.append(item)\n    return bucket[:{n}]",
        f"def is_even(n):\n    return n % 2 == 1 or n == {n * 2}",
    ))
    return f"This function has a bug. Find it and fix it:\n```python\n{snippet}\n```"


_REGEX_TARGETS = ("email addresses", "US phone numbers", "ISO 8601 dates", "IPv4 addresses",
                  "hex colour codes like #a1b2c3", "semantic version strings like 1.4.2",
                  "words that start and end with the same letter", "Python identifiers",
                  "UK postcodes", "times in 24-hour HH:MM format", "URLs that use https",
                  "numbers with thousands separators", "repeated words like 'the the'")


def _code_task_regex(rng):
    return rng.choice(("Write a regular expression that matches {t} and explain each part.",
                       "Write a Python function that extracts all {t} from a text using `re`.",
                       "How can I validate {t} in Python? Show code.")).format(t=rng.choice(_REGEX_TARGETS))


_CODE_TASKS = (
    _code_task_lists, _code_task_strings, _code_task_numbers, _code_task_other_language,
    _code_task_dates, _code_task_records, _code_task_class, _code_task_algorithm,
    _code_task_predict, _code_task_bugfix, _code_task_regex,
)


def _code_prompt(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return _api_prompt(rng)
    return rng.choice(_CODE_TASKS)(rng)


# --------------------------------------------------------------------------------------------
# Code stubs: a typed signature and a docstring with worked examples, body left to write
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stub:
    """A small function to complete. ``solve`` is the reference solution that computes the
    docstring's examples (never written by hand); ``draw`` gives random arguments."""

    name: str
    params: str
    returns: str
    doc: str
    solve: Callable
    draw: Callable[[random.Random], tuple]


def _ints(rng: random.Random, lo: int = -9, hi: int = 30, n: tuple[int, int] = (3, 8)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(_STUB_WORDS) for _ in range(rng.randint(3, 7)))


def _max_run(values: Sequence[int]) -> int:
    best = run = 1 if values else 0
    for a, b in zip(values, values[1:]):
        run = run + 1 if b > a else 1
        best = max(best, run)
    return best


def _rle(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{text[i]}{j - i}")
        i = j
    return "".join(out)


def _balanced(text: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n, steps = (n // 2 if n % 2 == 0 else 3 * n + 1), steps + 1
    return steps


def _triangle(a: int, b: int, c: int) -> str:
    if a + b <= c or a + c <= b or b + c <= a:
        return "invalid"
    return {1: "equilateral", 2: "isosceles"}.get(len({a, b, c}), "scalene")


def _shift(text: str, k: int) -> str:
    return "".join(chr((ord(ch) - base + k) % 26 + base) if ch.isalpha() else ch
                   for ch in text for base in [ord("a") if ch.islower() else ord("A")])


_STUB_WORDS = ("apple", "river", "Stone", "level", "noon", "quiet", "banana", "Orbit", "tree", "radar",
               "cloud", "ember", "kayak", "light", "Mango", "sky", "zebra", "otter", "paper", "moon")

_STUBS = (
    _Stub("running_max", "values: List[int]", "List[int]",
          "For each position, return the largest value seen up to and including it.",
          lambda v: [max(v[: i + 1]) for i in range(len(v))], lambda r: (_ints(r),)),
    _Stub("adjacent_differences", "values: List[int]", "List[int]",
          "Return the difference between every element and the element before it.",
          lambda v: [b - a for a, b in zip(v, v[1:])], lambda r: (_ints(r),)),
    _Stub("count_above", "values: List[int], limit: int", "int",
          "Count the values that are strictly greater than limit.",
          lambda v, t: sum(x > t for x in v), lambda r: (_ints(r), r.randint(0, 15))),
    _Stub("second_largest", "values: List[int]", "Optional[int]",
          "Return the second largest distinct value, or None if there are fewer than two\n"
          "distinct values.",
          lambda v: sorted(set(v))[-2] if len(set(v)) > 1 else None,
          lambda r: (_ints(r, 0, 9, (1, 6)),)),
    _Stub("longest_rising_run", "values: List[int]", "int",
          "Return the length of the longest stretch of adjacent values that keeps strictly\n"
          "increasing. An empty list has length 0.",
          _max_run, lambda r: (_ints(r, 0, 12, (0, 9)),)),
    _Stub("rotate_left", "values: List[int], k: int", "List[int]",
          "Move the first k elements to the end, keeping their order. k may exceed the length.",
          lambda v, k: v[k % len(v):] + v[: k % len(v)] if v else [],
          lambda r: (_ints(r, 0, 9), r.randint(0, 9))),
    _Stub("chunked", "values: List[int], size: int", "List[List[int]]",
          "Split values into consecutive pieces of the given size; the last piece may be shorter.",
          lambda v, s: [v[i:i + s] for i in range(0, len(v), s)], lambda r: (_ints(r, 0, 9), r.randint(1, 4))),
    _Stub("unique_in_order", "values: List[int]", "List[int]",
          "Drop repeated values, keeping the first time each one appears.",
          lambda v: list(dict.fromkeys(v)), lambda r: (_ints(r, 0, 6, (3, 10)),)),
    _Stub("alternating_sum", "values: List[int]", "int",
          "Add the values at even positions and subtract those at odd positions.",
          lambda v: sum(x if i % 2 == 0 else -x for i, x in enumerate(v)), lambda r: (_ints(r),)),
    _Stub("index_of_smallest", "values: List[int]", "int",
          "Return the position of the smallest value (the first one on ties), or -1 for an empty list.",
          lambda v: v.index(min(v)) if v else -1, lambda r: (_ints(r, 0, 9, (0, 7)),)),
    _Stub("has_pair_with_sum", "values: List[int], target: int", "bool",
          "Tell whether two elements at different positions add up to target.",
          lambda v, t: any(v[i] + v[j] == t for i in range(len(v)) for j in range(i + 1, len(v))),
          lambda r: (_ints(r, 0, 12), r.randint(2, 20))),
    _Stub("zeros_to_end", "values: List[int]", "List[int]",
          "Move every zero to the end of the list and keep the other values in their order.",
          lambda v: [x for x in v if x] + [0] * v.count(0), lambda r: (_ints(r, 0, 4),)),
    _Stub("products_without_self", "values: List[int]", "List[int]",
          "Return a list whose i-th entry is the product of all values except the i-th one.",
          lambda v: [math.prod(v[:i] + v[i + 1:]) for i in range(len(v))], lambda r: (_ints(r, 1, 6, (2, 5)),)),
    _Stub("flatten_once", "nested: List[List[int]]", "List[int]",
          "Join the inner lists into one flat list, in order.",
          lambda n: [x for inner in n for x in inner],
          lambda r: ([_ints(r, 0, 9, (0, 3)) for _ in range(r.randint(1, 4))],)),
    _Stub("count_vowels", "text: str", "int",
          "Count the letters a, e, i, o and u in text, in upper or lower case.",
          lambda t: sum(ch in "aeiouAEIOU" for ch in t), lambda r: (_sentence(r),)),
    _Stub("reverse_word_order", "sentence: str", "str",
          "Return the words of the sentence in reverse order, separated by single spaces.",
          lambda s: " ".join(reversed(s.split())), lambda r: (_sentence(r),)),
    _Stub("is_mirror_word", "word: str", "bool",
          "Tell whether word reads the same backwards, ignoring upper and lower case.",
          lambda w: w.lower() == w.lower()[::-1], lambda r: (r.choice(_STUB_WORDS),)),
    _Stub("run_length", "text: str", "str",
          "Encode text as each character followed by how many times it repeats in a row.",
          _rle, lambda r: ("".join(r.choice("aab") * r.randint(1, 3) for _ in range(r.randint(1, 4))),)),
    _Stub("title_words", "text: str", "str",
          "Upper-case the first letter of every word and lower-case the rest.",
          lambda t: " ".join(w[:1].upper() + w[1:].lower() for w in t.split()), lambda r: (_sentence(r),)),
    _Stub("longest_word", "sentence: str", "str",
          "Return the longest word of the sentence; when several are equally long, the first.",
          lambda s: max(s.split(), key=len), lambda r: (_sentence(r),)),
    _Stub("letter_counts", "text: str", "Dict[str, int]",
          "Map each letter of text (lower-cased) to how often it occurs, in order of first\n"
          "appearance. Spaces are not letters.",
          lambda t: {ch: t.lower().count(ch) for ch in dict.fromkeys(t.lower()) if ch.isalpha()},
          lambda r: (r.choice(_STUB_WORDS) + r.choice(("", " " + r.choice(_STUB_WORDS))),)),
    _Stub("shared_prefix", "words: List[str]", "str",
          "Return the longest string that every word starts with ('' when there is none).",
          lambda ws: "" if not ws else next((ws[0][:i] for i in range(len(ws[0]), -1, -1)
                                             if all(w.startswith(ws[0][:i]) for w in ws)), ""),
          lambda r: ([r.choice(("inter", "pre", "sub", "")) + r.choice(_STUB_WORDS).lower()
                      for _ in range(r.randint(2, 4))],)),
    _Stub("brackets_match", "text: str", "bool",
          "Tell whether every (, [ and { in text is closed by the matching bracket in the right order.",
          _balanced, lambda r: ("".join(r.choice("()[]{}") for _ in range(r.randint(2, 8))),)),
    _Stub("shift_letters", "text: str, k: int", "str",
          "Shift every letter k places along the alphabet, wrapping around and keeping its case;\n"
          "other characters stay as they are.",
          _shift, lambda r: (_sentence(r), r.randint(1, 25))),
    _Stub("digit_sum", "n: int", "int",
          "Return the sum of the decimal digits of n (the sign is ignored).",
          lambda n: sum(map(int, str(abs(n)))), lambda r: (r.randint(-9999, 99999),)),
    _Stub("is_prime", "n: int", "bool",
          "Tell whether n is a prime number.",
          lambda n: n > 1 and all(n % d for d in range(2, math.isqrt(n) + 1)), lambda r: (r.randint(-3, 120),)),
    _Stub("gcd_of_all", "values: List[int]", "int",
          "Return the greatest common divisor of all the values (0 for an empty list).",
          lambda v: math.gcd(*v), lambda r: ([r.randint(1, 6) * r.choice((2, 3, 4, 6)) for _ in range(r.randint(2, 4))],)),
    _Stub("binary_string", "n: int", "str",
          "Write the non-negative integer n in base 2, without a prefix.",
          lambda n: format(n, "b"), lambda r: (r.randint(0, 300),)),
    _Stub("divisor_count", "n: int", "int",
          "Count the positive divisors of the positive integer n.",
          lambda n: sum(n % d == 0 for d in range(1, n + 1)), lambda r: (r.randint(1, 100),)),
    _Stub("collatz_steps", "n: int", "int",
          "Count the steps to reach 1 when an even n is halved and an odd n becomes 3n + 1.",
          _collatz, lambda r: (r.randint(1, 40),)),
    _Stub("squares_below", "n: int", "int",
          "Return the sum of k * k over every integer k with 0 <= k < n.",
          lambda n: sum(k * k for k in range(n)), lambda r: (r.randint(0, 15),)),
    _Stub("round_to_multiple", "n: int, m: int", "int",
          "Round n to the nearest multiple of m; exactly halfway rounds up.",
          lambda n, m: (n + m // 2) // m * m,
          lambda r: (r.randint(0, 200), r.choice((3, 4, 5, 10, 25)))),
    _Stub("triangle_kind", "a: int, b: int, c: int", "str",
          "Classify the triangle with these side lengths as 'equilateral', 'isosceles' or\n"
          "'scalene', or return 'invalid' when the sides cannot form a triangle.",
          _triangle, lambda r: tuple(r.randint(1, 6) for _ in range(3))),
)
_STUB_PREFIXES = (HUMANEVAL_PREFIX + "\n", HUMANEVAL_PREFIX + "\n", "Complete the following Python function:\n",
                  "Fill in the body of this function so that the examples in its docstring hold:\n", "")
_STUB_SUFFIXES = ("", "", "", "\nImplement the function above.")


def _stub_prompt(rng: random.Random) -> str:
    stub = rng.choice(_STUBS)
    typing = sorted(name for name in ("Dict", "List", "Optional") if f"{name}[" in stub.params + stub.returns)
    head = f"from typing import {', '.join(typing)}\n\n\n" if typing else "\n\n"
    examples = []
    draws = (stub.draw(rng) for _ in range(rng.randint(1, 3)))
    for args in {repr(a): a for a in draws}.values():  # each distinct example once, in draw order
        call = ", ".join(map(repr, args))
        result = stub.solve(*args)
        # A doctest shows nothing for None, so that case is written as a comparison.
        shown = (f"{stub.name}({call}) is None", True) if result is None else (f"{stub.name}({call})", result)
        examples.append(f"    >>> {shown[0]}\n    {shown[1]!r}")
    doc = textwrap.indent(stub.doc, "    ").lstrip()
    body = f"{head}def {stub.name}({stub.params}) -> {stub.returns}:\n    \"\"\" {doc}\n" + "\n".join(examples) + '\n    """\n'
    return f"{rng.choice(_STUB_PREFIXES)}```python\n{body}\n```{rng.choice(_STUB_SUFFIXES)}"


# --------------------------------------------------------------------------------------------
# Chat: stdlib prose passages and open questions
# --------------------------------------------------------------------------------------------

_PROSE_MODULES = _CODE_MODULES + (
    "asyncio", "bdb", "cmd", "code", "codecs", "concurrent.futures", "copyreg", "doctest", "email",
    "fileinput", "ftplib", "getpass", "html.parser", "http", "http.client", "imaplib", "io",
    "mailbox", "modulefinder", "multiprocessing", "os", "pdb", "pickle", "pkgutil", "poplib",
    "profile", "py_compile", "pyclbr", "pydoc", "runpy", "select", "selectors", "shelve", "site",
    "smtplib", "socket", "socketserver", "stat", "subprocess", "symtable", "sys", "tabnanny",
    "tarfile", "threading", "trace", "unittest", "wsgiref", "xmlrpc.client", "zipimport",
)
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")


def _prose_paragraphs(text: str) -> list[str]:
    """Passages of 120-420 characters from paragraphs without code, grammar rules or tables;
    longer paragraphs are cut into runs of whole sentences."""
    out = []

    def emit(chunk: str) -> None:
        if 120 <= len(chunk) <= 420 and chunk.endswith("."):
            out.append(chunk)

    for para in text.split("\n\n"):
        if any(line.startswith("   ") for line in para.splitlines()) or ">>>" in para or "::=" in para:
            continue
        flat = " ".join(para.split())
        if not flat[:1].isupper() or flat.startswith(
                ("Changed in version", "New in version", "Deprecated since", "See also")):
            continue
        if sum(ch.isalpha() or ch.isspace() for ch in flat) < 0.9 * len(flat):
            continue
        chunk = ""
        for sentence in _SENTENCE_BREAK.split(flat):
            if chunk and len(chunk) + 1 + len(sentence) > 420:
                emit(chunk)
                chunk = ""
            chunk = f"{chunk} {sentence}".lstrip()
        emit(chunk)
    return out


@functools.lru_cache(maxsize=1)
def _passages() -> tuple[str, ...]:
    """Prose from the language reference (``pydoc_data.topics``) and stdlib module docstrings."""
    texts = []
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data out; the module docs still work
        topics = {}
    texts += [topics[key] for key in sorted(topics)]
    for name in _PROSE_MODULES:
        doc = inspect.getdoc(importlib.import_module(name))
        if doc:
            texts.append(doc)
    seen, out = set(), []
    for text in texts:
        for para in _prose_paragraphs(text):
            if para not in seen:
                seen.add(para)
                out.append(para)
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _zen() -> tuple[str, ...]:
    """The Zen of Python's aphorisms (importing `this` prints them, so keep stdout quiet)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return tuple(line for line in codecs.decode(this.s, "rot13").splitlines()[2:] if line)


_PASSAGE_TEMPLATES = (
    "Summarise this passage in {n} sentences:\n\n{p}",
    "What is the main point of the following text?\n\n{p}",
    "Continue this text with another paragraph in the same style:\n\n{p}",
    "Explain the following passage to someone who has never programmed:\n\n{p}",
    "Read the passage and write {n} questions that it answers:\n\n{p}",
    "Suggest a short title for this passage and explain your choice:\n\n{p}",
    "Rewrite this passage in plain, simple English:\n\n{p}",
    "Is anything in this passage unclear or ambiguous? Explain.\n\n{p}",
    "{p}\n\nGive a concrete example that illustrates the passage above.",
    "Turn this passage into a short FAQ with {n} questions and answers:\n\n{p}",
    "{p}\n\nWhat would a newcomer most likely misunderstand here?",
)
_ZEN_TEMPLATES = (
    "What does the Python proverb \"{z}\" mean? Give an example.",
    "Do you agree with the saying \"{z}\"? Argue both sides.",
    "How does \"{z}\" apply outside programming, for example in writing or design?",
)

_ACTIVITIES = (
    "learning a new language", "running a first marathon", "saving money on groceries",
    "studying for exams", "starting a vegetable garden", "working from home", "sleeping better",
    "public speaking", "taking better photos with a phone", "cooking for a large group",
    "keeping a journal", "training a puppy", "reducing screen time", "moving to a new city",
    "negotiating a salary", "learning to draw", "writing a CV", "hosting a board game night",
    "cycling to work", "reading more books", "preparing for a job interview", "camping in the rain",
    "organising a small wedding", "learning chess", "decluttering a flat", "staying focused",
    "making friends as an adult", "caring for houseplants", "writing clear emails", "baking bread",
    "learning to swim", "travelling on a budget", "managing a small team", "composting at home",
    "learning the guitar", "giving constructive feedback", "running a book club", "meal prepping",
    "starting a podcast", "teaching a child to ride a bike", "volunteering locally",
    "keeping a long-distance friendship", "writing a novel", "birdwatching", "learning to knit",
    "cutting household energy use", "driving in snow", "planning a surprise party",
    "learning statistics", "recovering from jet lag", "running effective meetings",
)
_CONCEPTS = (
    "photosynthesis", "inflation", "compound interest", "gravity", "the water cycle", "vaccines",
    "supply and demand", "black holes", "electricity", "democracy", "evolution", "the internet",
    "climate change", "DNA", "encryption", "recycling", "tides", "volcanoes", "the stock market",
    "machine learning", "rainbows", "the immune system", "time zones", "plate tectonics", "taxes",
    "probability", "the greenhouse effect", "bacteria", "the moon's phases", "magnetism",
    "renewable energy", "memory in the brain", "opportunity cost", "sound waves", "erosion",
    "blockchains", "antibiotics", "the placebo effect", "seasons", "how a bill becomes law",
    "interest rates", "the speed of light", "atoms", "the food chain", "earthquakes",
    "the Pythagorean theorem", "exchange rates", "insulation", "fermentation", "satellites",
    "the rule of law", "habits", "muscle growth", "clouds", "the printing of money",
    "search engines", "batteries", "the carbon cycle", "echoes", "the scientific method",
)
_AUDIENCES = ("a ten-year-old", "a high-school student", "a grandparent", "a new employee",
              "a curious teenager", "someone who speaks little English", "a busy manager",
              "a university student from another field", "a five-year-old", "a journalist")
_PAIRS = (
    ("tea", "coffee"), ("renting", "buying a home"), ("cats", "dogs"), ("trains", "planes"),
    ("e-books", "paper books"), ("Python", "JavaScript"), ("solar power", "wind power"),
    ("city life", "country life"), ("running", "swimming"), ("email", "instant messaging"),
    ("a gap year", "going straight to university"), ("stocks", "bonds"), ("SQL", "NoSQL databases"),
    ("classical music", "jazz"), ("electric cars", "hybrid cars"), ("Linux", "Windows"),
    ("working in a startup", "working in a large company"), ("baking", "frying"),
    ("learning alone", "learning in a group"), ("board games", "video games"),
    ("weather", "climate"), ("viruses", "bacteria"), ("a debit card", "a credit card"),
    ("yoga", "pilates"), ("podcasts", "audiobooks"), ("hiking boots", "trail runners"),
    ("a laptop", "a desktop computer"), ("Rome", "Athens"), ("cash", "card payments"),
    ("freelancing", "a salaried job"), ("a novel", "a short story"), ("crocodiles", "alligators"),
)
_CHOICES = (
    "remote work", "social media for teenagers", "a four-day work week", "nuclear power",
    "homeschooling", "self-driving cars", "open-plan offices", "learning to code at school",
    "living with roommates", "cashless payments", "fast fashion", "standing desks",
    "online degrees", "a vegetarian diet", "smart home devices", "public transport subsidies",
    "school uniforms", "car-free city centres", "buying second-hand clothes", "a universal basic income",
    "daylight saving time", "working night shifts", "keeping a pet rabbit", "studying abroad",
)
_CHARACTERS = ("a lighthouse keeper", "a retired astronaut", "a shy robot", "a street musician",
               "a baker in a small village", "a lost dog", "a young inventor", "a ship's cook",
               "a museum night guard", "a beekeeper", "a detective who cannot read", "a librarian",
               "a grumpy cat", "a twelve-year-old chess champion", "a forgetful wizard", "a taxi driver",
               "an old fisherman", "a nervous substitute teacher")
_EVENTS = ("finds a map in an old book", "wakes up speaking a new language", "misses the last train",
           "receives a letter from the future", "has to save a festival", "befriends a stranger",
           "loses a precious key", "is asked to keep a secret", "gets stuck in a lift",
           "discovers a hidden garden", "wins a prize by mistake", "must cross a desert",
           "meets their childhood hero", "finds a talking parrot", "has one day to learn to dance")
_TASKS = (
    "change a flat bicycle tyre", "make a budget spreadsheet", "remove a red wine stain",
    "back up my phone", "prepare for a long flight", "write a thank-you note", "fix a slow laptop",
    "plan a week of healthy meals", "start running as a beginner", "choose a good password",
    "get better at mental arithmetic", "make a simple website", "repot a plant", "set up a home network",
    "calm down before an exam", "brew good filter coffee", "learn touch typing", "sharpen a kitchen knife",
    "unclog a sink", "read a nutrition label", "pick a good watermelon", "write a cover letter",
    "prepare a short presentation", "say no politely", "clean a cast-iron pan", "paint a room",
    "choose a used car", "store fresh herbs", "stop procrastinating", "memorise a speech",
)
_RECIPIENTS = ("my landlord", "a teacher", "a new client", "my team", "a neighbour",
               "a hiring manager", "the city council", "a supplier", "an old friend", "my manager")
_PURPOSES = ("asking to reschedule a meeting", "about a late delivery", "thanking them for their help",
             "requesting a day off", "proposing a small project", "about a noise problem",
             "following up on an unanswered message", "announcing a change of address",
             "declining an invitation", "asking for a reference", "apologising for a mistake")
_PLACES = ("Lisbon", "Kyoto", "Cape Town", "Montreal", "Istanbul", "the Scottish Highlands",
           "Oaxaca", "Hanoi", "Reykjavik", "Marrakesh", "Vancouver", "Sicily", "Seoul", "Patagonia",
           "Tasmania", "Kraków", "Cartagena", "Zanzibar", "Lake Bled", "Rajasthan")
_WHO = ("a family with young children", "two students on a budget", "an elderly couple",
        "a solo traveller", "a group of friends who like hiking", "a food lover",
        "someone who uses a wheelchair")
_OCCUPATIONS = ("nurse", "air traffic controller", "beekeeper", "software tester", "marine biologist",
                "chef", "librarian", "firefighter", "translator", "park ranger", "architect", "pilot",
                "electrician", "zookeeper", "midwife", "sound engineer", "carpenter", "pharmacist",
                "journalist", "farmer", "data analyst", "tailor")
_HISTORY = ("the printing press", "the bicycle", "coffee", "the Olympic Games", "paper money",
            "the telephone", "chess", "the calendar", "vaccination", "the compass", "pizza",
            "the postal service", "jeans", "the piano", "maps", "the umbrella", "glass",
            "the lightbulb", "tea", "the marathon", "public libraries", "the zero", "soap")
_PRODUCTS = ("a reusable water bottle", "a folding bicycle", "noise-cancelling headphones",
             "a solar phone charger", "a handmade ceramic mug", "a smart thermostat", "hiking boots",
             "a wool blanket", "an e-reader", "a cast-iron skillet", "a kids' science kit")
_DECISIONS = ("adopting a dog", "changing careers", "buying an electric car", "moving abroad",
              "starting a small business", "going back to university", "buying a house",
              "taking a sabbatical", "learning to fly", "getting solar panels")
_OCCASIONS = ("a friend's wedding", "a colleague's retirement", "a school graduation",
              "the opening of a community garden", "a team's end-of-season dinner",
              "a grandparent's 90th birthday")
_CONFUSED = (("affect", "effect"), ("weather", "whether"), ("principal", "principle"),
             ("complement", "compliment"), ("fewer", "less"), ("its", "it's"),
             ("imply", "infer"), ("stationary", "stationery"), ("lose", "loose"),
             ("historic", "historical"), ("economic", "economical"), ("discreet", "discrete"))
_WHAT_IFS = ("the moon disappeared", "everyone had to work only three days a week",
             "humans could photosynthesise", "the internet went down for a month",
             "all cars were banned from cities", "people lived to 150", "it never rained again",
             "every school taught cooking", "money did not exist", "animals could talk")
_INTERESTS = ("science fiction", "cooking", "history", "mountains", "jazz", "board games",
              "gardening", "mystery novels", "astronomy", "architecture")
_RECOMMEND = ("books", "films", "podcasts", "hobbies", "day trips", "board games", "recipes")
_STYLES = ("", "", "", " Keep it short.", " Use simple language.", " Give an example.",
           " Use an analogy.", " Answer in a friendly tone.")

_OPEN_TEMPLATES = (
    lambda r: f"Give me {r.randint(3, 10)} tips for {r.choice(_ACTIVITIES)}.",
    lambda r: f"Explain {r.choice(_CONCEPTS)} to {r.choice(_AUDIENCES)}.",
    lambda r: "Compare {} and {}.".format(*r.choice(_PAIRS)),
    lambda r: "What are the main differences between {} and {}?".format(*r.choice(_PAIRS)),
    lambda r: "Which is better for {}: {} or {}?".format(r.choice(_WHO), *r.choice(_PAIRS)),
    lambda r: f"What are the pros and cons of {r.choice(_CHOICES)}?",
    lambda r: f"Write a short story about {r.choice(_CHARACTERS)} who {r.choice(_EVENTS)}.",
    lambda r: f"Write a polite email to {r.choice(_RECIPIENTS)} {r.choice(_PURPOSES)}.",
    lambda r: f"How do I {r.choice(_TASKS)}?",
    lambda r: f"Plan a {r.randint(2, 7)}-day trip to {r.choice(_PLACES)} for {r.choice(_WHO)}.",
    lambda r: f"Describe a typical working day of {_a(r.choice(_OCCUPATIONS))}.",
    lambda r: f"What is the history of {r.choice(_HISTORY)}? Keep it brief.",
    lambda r: f"Suggest {r.randint(3, 8)} names for a {r.choice(('bakery', 'bookshop', 'podcast', 'cycling club', 'coffee cart', 'board game cafe', 'dog-walking service', 'repair shop'))} and explain each.",
    lambda r: f"Write a product description for {r.choice(_PRODUCTS)}.",
    lambda r: f"Why do some people find {r.choice(_ACTIVITIES)} hard, and what helps?",
    lambda r: f"What questions would you ask {_a(r.choice(_OCCUPATIONS))} about their job?",
    lambda r: f"Is {r.choice(_CHOICES)} a good idea? Give a balanced answer.",
    lambda r: f"What is a common misconception about {r.choice(_CONCEPTS)}?",
    lambda r: f"What should I consider before {r.choice(_DECISIONS)}?",
    lambda r: f"Write a short speech for {r.choice(_OCCASIONS)}.",
    lambda r: "What is the difference between \"{}\" and \"{}\"? Give example sentences.".format(*r.choice(_CONFUSED)),
    lambda r: f"What would happen if {r.choice(_WHAT_IFS)}?",
    lambda r: f"Recommend {r.randint(3, 7)} {r.choice(_RECOMMEND)} for someone who likes {r.choice(_INTERESTS)}.",
    lambda r: f"Give me a plan of {r.randint(3, 8)} steps for {r.choice(_ACTIVITIES)}.",
    lambda r: f"How would {_a(r.choice(_OCCUPATIONS))} explain {r.choice(_CONCEPTS)}?",
    lambda r: f"Describe {r.choice(_PLACES)} to someone who has never been there.",
    lambda r: f"What skills does a good {r.choice(_OCCUPATIONS)} need, and how can I learn them?",
)


def _open_question(rng: random.Random) -> str:
    return rng.choice(_OPEN_TEMPLATES)(rng) + rng.choice(_STYLES)


def _chat_prompt(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.5:
        return rng.choice(_PASSAGE_TEMPLATES).format(p=rng.choice(_passages()), n=rng.randint(2, 5))
    if r < 0.53:
        return rng.choice(_ZEN_TEMPLATES).format(z=rng.choice(_zen()))
    return _open_question(rng)


# --------------------------------------------------------------------------------------------
# Assistant tasks: multi-part writing, role-play, reasoning puzzles, extraction, explanations
# --------------------------------------------------------------------------------------------

_FORMS = ("blog post", "magazine column", "newsletter article", "short essay", "radio script",
          "social media thread", "letter to the editor", "speech")
_ANGLES = ("its food and markets", "the people you met", "its history and architecture",
           "getting around cheaply", "what surprised you most", "the best views", "local festivals")
_TONES = ("humorous", "persuasive", "nostalgic", "formal", "enthusiastic", "thoughtful", "concise")
_ROLES = ("a ship's captain in 1850", "a medieval court jester", "a football coach at half-time",
          "a museum tour guide", "a detective interviewing a witness", "a patient chess grandmaster",
          "a Martian visiting Earth for the first time", "a personal trainer", "a wise old tortoise",
          "a customer-service agent for a bicycle shop", "a radio weather presenter", "a travel agent",
          "a nutritionist", "a kindergarten teacher", "a career counsellor", "a film critic")
_ROLE_QUESTIONS = ("How do you deal with a difficult day?", "What advice would you give a beginner?",
                   "Describe your favourite memory.", "What is the most important rule in your work?",
                   "Convince me to try something new.", "Tell me about a mistake you learned from.",
                   "What does a perfect weekend look like for you?", "Explain your job to a child.")
_FIELDS = ("name", "age", "city", "occupation", "year", "prize")
_PRIZES = ("a regional science award", "a cooking contest", "a chess tournament", "a poetry prize",
           "a marathon", "a photography competition", "a startup grant")


def _task_writing(rng):
    extra = rng.choice(("", f" Keep it under {rng.randint(15, 40) * 10} words.", f" Use a {rng.choice(_TONES)} tone.",
                        " End with a question for the reader.", f" Include {rng.randint(2, 5)} concrete details."))
    return rng.choice((
        f"Write a {rng.choice(_TONES)} {rng.choice(_FORMS)} about a week in {rng.choice(_PLACES)}, focusing on {rng.choice(_ANGLES)}.",
        f"Draft a {rng.choice(_FORMS)} reviewing {rng.choice(_PRODUCTS)} after a month of daily use, with one strength and one weakness.",
        f"Write a {rng.choice(_FORMS)} arguing for or against {rng.choice(_CHOICES)}, addressing the strongest objection.",
        f"Create a dialogue between {rng.choice(_CHARACTERS)} and {rng.choice(_CHARACTERS)} who disagree about {rng.choice(_CHOICES)}.",
        f"Invent a memorable character who works as {_a(rng.choice(_OCCUPATIONS))} and describe them in vivid detail.",
        f"Write the opening paragraph of a mystery set in {rng.choice(_PLACES)} in which {rng.choice(_CHARACTERS)} {rng.choice(_EVENTS)}.",
        f"Suggest {rng.randint(3, 6)} catchy headlines for an article about {rng.choice(_CONCEPTS)}, and say which one you prefer.",
    )) + extra


def _task_roleplay(rng):
    role = rng.choice(_ROLES)
    return rng.choice((
        f"Pretend to be {role} for the rest of this conversation. {rng.choice(_ROLE_QUESTIONS)}",
        f"You are {role}. Stay in character and answer: {rng.choice(_ROLE_QUESTIONS)}",
        f"Play the role of {role}. I am {rng.choice(_AUDIENCES)} who wants help with {rng.choice(_ACTIVITIES)}. What do you tell me?",
        f"Imagine you are {role} and write a short note to {rng.choice(_RECIPIENTS)} {rng.choice(_PURPOSES)}.",
    ))


def _task_reasoning(rng, *, distinct_people: bool):
    if distinct_people:
        a, b, c = (name for name, _ in rng.sample(_PEOPLE, 3))
    else:  # version 1 (frozen): c may repeat a or b, "A is taller than B, and B is taller than A"
        (a, _), (b, _) = _two_people(rng)
        c = _person(rng)[0]
    days = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
    adjective = rng.choice(("taller", "older", "faster", "richer", "earlier to arrive"))
    n = rng.randint(3, 9)
    return rng.choice((
        f"{a} is {adjective} than {b}, and {b} is {adjective} than {c}. Is {c} {adjective} than {a}? Explain your reasoning.",
        f"If the day after tomorrow is {rng.choice(days)}, what day was it {rng.randint(2, 5)} days ago? Explain step by step.",
        f"{a} overtakes the person in position {n} of a race. What position is {a} in now, and who is last? Think carefully.",
        f"A box holds only red and blue pens. {a} says at least one pen is red; {b} says at most {n} pens are blue. Can both be right if there are {n + rng.randint(1, 4)} pens? Explain.",
        f"{a}, {b} and {c} each own one of a cat, a dog and a parrot. {a} does not own the dog and {c} owns the parrot. Who owns what?",
        f"A clock shows {rng.randint(1, 11)}:{rng.choice(('00', '15', '30', '45'))}. What is the angle between its hands? Show your reasoning.",
        "Which is heavier: a kilogram of {} or a kilogram of {}? Explain any trick in the question.".format(*rng.sample(_INGREDIENTS, 2)),
    ))


def _task_extraction(rng, *, articles: bool):
    people = rng.sample(_PEOPLE, 3)
    # Version 1 (frozen) always wrote "a", giving "a air traffic controller".
    article = _a if articles else (lambda noun: f"a {noun}")
    lines = [f"{name}, {rng.randint(19, 70)}, {article(rng.choice(_OCCUPATIONS))} from {rng.choice(_PLACES)}, won "
             f"{rng.choice(_PRIZES)} in {rng.randint(1990, 2024)}." for name, _ in people]
    fields = ", ".join(rng.sample(_FIELDS, rng.randint(2, 4)))
    return rng.choice((
        f"Extract the {fields} of each person from the text below and output a JSON list.\n\n" + " ".join(lines),
        "Read these sentences and list every place and every number they mention:\n\n" + "\n".join(lines),
        f"From the following passage, pick out the {rng.randint(2, 5)} most important technical terms and define each one.\n\n{rng.choice(_passages())}",
        f"Identify the named entities (people, places, prizes) in this text and group them by type:\n\n{' '.join(lines)}",
        f"Turn this passage into a table of key facts with the columns Fact and Detail:\n\n{rng.choice(_passages())}",
    ))


def _task_explain(rng):
    a, b = rng.sample(_CONCEPTS, 2)
    return rng.choice((
        f"What is {a}, and how is it related to {b}? Give a real-world example of each.",
        f"Explain {a} step by step, then list {rng.randint(2, 4)} common questions people ask about it, with answers.",
        f"Discuss how {rng.choice(_HISTORY)} changed everyday life, and compare its impact in two different countries.",
        f"Describe {rng.randint(3, 6)} key principles for judging whether an argument about {rng.choice(_CHOICES)} is sound.",
        f"Outline a {rng.randint(3, 5)}-lesson plan that teaches {a} to {rng.choice(_AUDIENCES)}, with one activity per lesson.",
        "How would you explain the difference between {} and {} to a friend? Then suggest a simple experiment or example.".format(*rng.choice(_PAIRS)),
    ))


def _task_prompt(rng: random.Random, version: int = 1) -> str:
    """Version 1 is frozen: leg 4's target cache holds its seed-4 texts, and fixing its two
    wording glitches would change them. Version 2 (domain ``task_v2``) has the fixes."""
    fixed = version >= 2
    kinds = (_task_writing, _task_roleplay, functools.partial(_task_reasoning, distinct_people=fixed),
             functools.partial(_task_extraction, articles=fixed), _task_explain)
    return rng.choice(kinds)(rng)


# --------------------------------------------------------------------------------------------
# Long-form writing: posts, stories, letters and essays of several paragraphs with a structure
# --------------------------------------------------------------------------------------------

_SCENES = ("a night market", "a harbour at dawn", "a crowded train station", "a mountain village in winter",
           "a school playground at lunchtime", "a flower show", "a bakery before opening", "a rainy bus stop",
           "a football stadium on match day", "an airport at midnight", "a fishing boat in a storm",
           "a desert campsite", "a second-hand bookshop", "a hospital corridor at night", "a summer fair")
_SENSES = ("smells", "sounds", "colours", "textures", "tastes", "movement", "light")
_GENRES = ("science-fiction", "fairy-tale", "mystery", "adventure", "comic", "ghost", "historical")
_OPENING_LINES = (
    "Nobody in the village had ever seen the clock tower stop.",
    "The parcel arrived with no stamp and no return address.",
    "On the first warm day of spring, the river turned silver.",
    "My grandmother kept one locked drawer in her kitchen.",
    "The last bus of the night was empty except for a man holding a violin.",
    "It took the robot three hundred years to learn how to laugh.",
    "When the power went out, the whole street came outside.",
    "The map had been drawn by someone who had never seen the sea.",
)
_EVENTS_TO_REPORT = ("a community clean-up day", "a charity bake sale", "a local science fair",
                     "a neighbourhood street party", "a company hackathon", "a school sports day",
                     "a small-town film festival", "a volunteer tree-planting weekend")
_LETTER_GOALS = (
    ("your manager", "asking for feedback on a project plan you wrote, with three specific questions"),
    ("a friend who is nervous about moving to a new city", "encouraging them and offering practical advice"),
    ("a local newspaper", "arguing that your town needs more cycle lanes"),
    ("a customer whose order arrived damaged", "apologising and explaining what you will do"),
    ("your future self in ten years", "describing your hopes and worries today"),
    ("a teacher who changed your life", "thanking them with specific memories"),
    ("a landlord", "asking for repairs to be made before winter"),
    ("a colleague who is shy about presenting", "persuading them to give a talk at a team event"),
)


def _longform_prompt(rng: random.Random) -> str:
    paragraphs = rng.randint(3, 6)
    prose = rng.choice((f"in {paragraphs} paragraphs", f"in about {rng.randint(3, 8) * 100} words", "of about one page"))
    article = rng.choice((prose, "with a title and short headed sections"))
    (a_angle, b_angle), (a, b) = rng.sample(_ANGLES, 2), rng.choice(_PAIRS)
    who, goal = rng.choice(_LETTER_GOALS)
    return rng.choice((
        f"Write an engaging blog post {article} about {rng.randint(2, 14)} days in {rng.choice(_PLACES)}, covering {a_angle} and {b_angle}.",
        f"Write {_a(rng.choice(_GENRES))} story {prose} that starts with the sentence: \"{rng.choice(_OPENING_LINES)}\"",
        f"Write {_a(rng.choice(_GENRES))} story {prose} about {rng.choice(_CHARACTERS)} who {rng.choice(_EVENTS)}.",
        f"Write a descriptive piece {prose} about {rng.choice(_SCENES)}, using its {' and '.join(rng.sample(_SENSES, 2))} to bring it to life.",
        f"Write a letter {prose} to {who}, {goal}.",
        f"Write an essay {prose} weighing the benefits and the harms of {rng.choice(_CHOICES)}, with an introduction and a conclusion.",
        f"Write a report for a community newsletter {article} about {rng.choice(_EVENTS_TO_REPORT)}: what happened, who helped and what comes next.",
        f"Write a detailed outline for an article comparing {a} and {b}, with {paragraphs} sections and two bullet points under each.",
        f"Write a personal reflection {prose} on what {rng.choice(_ACTIVITIES)} has taught you.",
        f"Write a speech {prose} for {rng.choice(_OCCASIONS)}, with a story from the past and a wish for the future.",
        f"Explain {rng.choice(_CONCEPTS)} in a feature article {article} for {rng.choice(_AUDIENCES)}, with an example in every part.",
    ))


# --------------------------------------------------------------------------------------------
# Instruction following: format constraints on chat questions
# --------------------------------------------------------------------------------------------

_JSON_KEYS = ("summary", "pros", "cons", "steps", "answer", "confidence", "examples", "sources",
              "title", "risks", "verdict", "keywords")
_ENDINGS = ("Hope this helps!", "That is all.", "Any other questions?", "End of answer.", "Good luck!")
_TRANSLATE_INTO = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch")


def _first_sentence(rng: random.Random) -> str:
    return re.split(r"(?<=[.!?])\s+(?=[A-Z])", rng.choice(_passages()))[0]


_INSTRUCTION_TEMPLATES = (
    lambda r: f"Answer in exactly {r.randint(2, 6)} bullet points: {_open_question(r)}",
    lambda r: "Respond only with JSON using the keys {}. {}".format(", ".join(f'"{k}"' for k in r.sample(_JSON_KEYS, r.randint(2, 4))), _open_question(r)),
    lambda r: f"Write a haiku about {r.choice(_CONCEPTS + _HISTORY)}.",
    lambda r: f"Rewrite in all caps: {_first_sentence(r)}",
    lambda r: f"Answer in fewer than {r.randint(3, 12) * 10} words: {_open_question(r)}",
    lambda r: f"Write a poem of {r.randint(3, 8)} lines about {r.choice(_CONCEPTS)} in which every line starts with the letter {r.choice('ABCDEFGHLMNPRSTW')}.",
    lambda r: f"Do not use any commas in your answer. {_open_question(r)}",
    lambda r: f"End your answer with the exact phrase \"{r.choice(_ENDINGS)}\" {_open_question(r)}",
    lambda r: f"Give your answer as a numbered list of {r.randint(3, 9)} items: {_open_question(r)}",
    lambda r: f"Translate this sentence into {r.choice(_TRANSLATE_INTO)}: {_first_sentence(r)}",
    lambda r: f"Write exactly {r.randint(2, 6)} sentences about {r.choice(_CONCEPTS)}, none longer than {r.randint(8, 20)} words.",
    lambda r: f"Reply with a Markdown table with the columns Name and Reason listing {r.randint(3, 7)} {r.choice(('books', 'habits', 'tools', 'foods', 'destinations', 'hobbies'))} for {r.choice(_WHO)}.",
    lambda r: f"Rewrite the following sentence in the passive voice: {_first_sentence(r)}",
    lambda r: f"Wrap your entire answer in double quotation marks. {_open_question(r)}",
    lambda r: f"Answer in all lowercase letters. {_open_question(r)}",
    lambda r: f"Use the word \"{r.choice(('simple', 'balance', 'bridge', 'light', 'change'))}\" at least {r.randint(2, 4)} times. {_open_question(r)}",
    lambda r: f"First repeat the request word for word, then answer it: {_open_question(r)}",
    lambda r: f"Give two different answers separated by six asterisks (******). {_open_question(r)}",
)


def _instruction_prompt(rng: random.Random) -> str:
    return rng.choice(_INSTRUCTION_TEMPLATES)(rng)


_GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "chat": _chat_prompt, "math": _math_prompt, "code": _code_prompt, "instruction": _instruction_prompt,
    "stub": _stub_prompt, "task": _task_prompt, "task_v2": functools.partial(_task_prompt, version=2),
    "longform": _longform_prompt,
}
# Named mixes (``TrainConfig.data_mix``). "formats" adds the two formats "paper" lacks, signature
# + docstring stubs to complete and multi-part assistant tasks; its shares are such that 640 of
# its prompts next to 1,864 "paper" prompts keep the paper's split of the whole set (chat 18 %,
# math 39 %, code 39 %) within a few points.
MIXES: dict[str, dict[str, float]] = {
    "paper": MIX,
    "formats": {"stub": 0.30, "code": 0.09, "math": 0.25, "task": 0.22, "chat": 0.10, "instruction": 0.04},
    # "writing" adds long-form writing (several paragraphs with a structure), the kind of chat
    # request that drafters trained on the other two mixes carried over to worst. No "code":
    # three paper seeds hold plenty of it, and its small template space has started to repeat
    # across seeds (and so to take texts from the held-out seed).
    "writing": {"longform": 0.30, "stub": 0.30, "math": 0.25, "task_v2": 0.10, "instruction": 0.05},
}


# --------------------------------------------------------------------------------------------
# Building the set
# --------------------------------------------------------------------------------------------


def _domain_counts(num_prompts: int, mix: Mapping[str, float]) -> dict[str, int]:
    """Largest-remainder rounding of ``num_prompts * share`` (ties go to the earlier domain)."""
    unknown = set(mix) - set(_GENERATORS)
    if unknown:
        raise ValueError(f"unknown domains {sorted(unknown)}; known: {sorted(_GENERATORS)}")
    total = sum(mix.values())
    if total <= 0 or any(v < 0 for v in mix.values()):
        raise ValueError(f"mix shares must be non-negative with a positive sum, got {dict(mix)}")
    exact = {d: num_prompts * share / total for d, share in mix.items()}
    counts = {d: math.floor(x) for d, x in exact.items()}
    order = sorted(mix, key=lambda d: -(exact[d] - counts[d]))  # stable: ties keep mix order
    for d in order[: num_prompts - sum(counts.values())]:
        counts[d] += 1
    return counts


def normalise_text(text: str) -> str:
    """Case- and whitespace-insensitive form of a prompt (what "the same prompt" means here)."""
    return " ".join(text.lower().split())


def build_prompts(num_prompts: int, seed: int = 0, mix: Mapping[str, float] = MIX) -> list[TrainingPrompt]:
    """`num_prompts` distinct prompts split across domains per `mix`, shuffled, fixed by `seed`.

    Each domain draws from its own ``random.Random(f"{seed}-{domain}")`` (string seeds hash the
    same in every process) and rejects texts already produced, so the set has no duplicates up
    to case and whitespace. Ids are ``f"{domain}-{index:06d}"``.
    """
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    if sys.flags.optimize >= 2:  # the code and chat pools read docstrings, which -OO strips
        raise ValueError("build_prompts: Python runs with -OO (or PYTHONOPTIMIZE=2), which strips the docstrings "
                         "the code and chat prompts are built from, so a seed would give other prompts: run "
                         "without it")
    seen: set[str] = set()
    prompts = []
    for domain, count in _domain_counts(num_prompts, mix).items():
        rng, generate = random.Random(f"{seed}-{domain}"), _GENERATORS[domain]
        attempts, made = 0, 0
        while made < count:
            attempts += 1
            if attempts > 50 * count + 1000:
                raise RuntimeError(f"{domain}: only {made} distinct prompts after {attempts} draws; "
                                   f"its generators cannot supply {count}")
            text = generate(rng)
            key = normalise_text(text)
            if key in seen:
                continue
            seen.add(key)
            prompts.append(TrainingPrompt(f"{domain}-{made:06d}", domain, text))
            made += 1
    random.Random(f"{seed}-order").shuffle(prompts)
    return prompts


def write_jsonl(prompts: Iterable[TrainingPrompt], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"id": p.id, "domain": p.domain, "text": p.text}, ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[TrainingPrompt]:
    """Training prompts from a JSONL file (``TrainConfig.prompts_file``, or what ``write_jsonl``
    wrote), one object a line: ``text`` (the user turn), and optionally ``id`` (default
    ``line-NNNNNN``, its line number) and ``domain`` (default ``custom``). Ids are unique, since the
    target cache names each answer by its prompt's id. A line that is not one is named by path:line."""
    from dspark_jax.decoding.batch_job import jsonl_objects

    prompts, lines = [], {}
    for number, where, record in jsonl_objects(path, "prompts"):
        if not isinstance(record.get("text"), str) or not record["text"].strip():
            raise ValueError(f"{where}: a training prompt is a JSON object with a non-empty string 'text'")
        unknown = sorted(set(record) - {"id", "domain", "text"})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown} (a training prompt has text, id and domain)")
        prompt = TrainingPrompt(record.get("id", f"line-{number:06d}"), record.get("domain", "custom"), record["text"])
        if not isinstance(prompt.id, str) or not prompt.id or not isinstance(prompt.domain, str):
            raise ValueError(f"{where}: 'id' and 'domain' are non-empty strings")
        if prompt.id in lines:
            raise ValueError(f"{where}: id {prompt.id!r} is also line {lines[prompt.id]}'s")
        lines[prompt.id] = number
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts")
    return prompts


# --------------------------------------------------------------------------------------------
# Benchmark contamination checks
# --------------------------------------------------------------------------------------------


def load_benchmark_prompts(path: str | Path) -> list[str]:
    """First turn of every ``{"turns": [...]}`` line of `path` (one .jsonl file, or every *.jsonl
    in a directory). Raises when there is nothing to read: an empty check would pass silently."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files or not files[0].exists():
        raise FileNotFoundError(f"no benchmark .jsonl files at {path}")
    texts = []
    for file in files:
        with open(file, encoding="utf-8") as f:
            texts += [json.loads(line)["turns"][0] for line in f if line.strip()]
    return texts


_BOILERPLATE_NORM = tuple(normalise_text(b) for b in BOILERPLATE)


def _words(text: str) -> list[str]:
    """Lowercased word tokens with the boilerplate removed; punctuation and spacing are ignored so
    that re-punctuating a copied sentence does not hide it."""
    text = normalise_text(text)
    for b in _BOILERPLATE_NORM:
        text = text.replace(b, " ")
    return re.findall(r"\w+", text)


def _spans(words: Sequence[str], n: int) -> Iterable[tuple[str, ...]]:
    return (tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def check_no_overlap(prompts: Iterable[TrainingPrompt | str], benchmark_texts: Iterable[str]) -> None:
    """Raise ValueError naming every prompt that copies a benchmark prompt.

    Overlap is an exact match after dropping case, spacing, punctuation and `BOILERPLATE`, or any
    shared span of `SHINGLE_WORDS` words. A benchmark prompt shorter than that counts as one span,
    so a training prompt containing it whole also overlaps (e.g. short MBPP tasks).
    """
    spans: dict[int, dict[tuple[str, ...], str]] = {}
    exact: dict[tuple[str, ...], str] = {}
    for text in benchmark_texts:
        words = _words(text)
        if not words:
            continue
        exact[tuple(words)] = text
        n = min(SHINGLE_WORDS, len(words))
        if n >= MIN_SPAN_WORDS:
            table = spans.setdefault(n, {})
            for span in _spans(words, n):
                table.setdefault(span, text)
    problems = []
    for i, prompt in enumerate(prompts):
        pid, text = (prompt.id, prompt.text) if isinstance(prompt, TrainingPrompt) else (f"#{i}", prompt)
        words = _words(text)
        hit = exact.get(tuple(words))
        for n, table in spans.items():
            if hit:
                break
            hit = next((table[s] for s in _spans(words, n) if s in table), None)
        if hit:
            problems.append(f"{pid}: {text[:80]!r} overlaps benchmark prompt {hit[:80]!r}")
    if problems:
        shown = "\n  ".join(problems[:20])
        raise ValueError(f"{len(problems)} training prompt(s) overlap the benchmarks:\n  {shown}")


def check_against_benchmarks(prompts: Sequence[TrainingPrompt], benchmark_dir: str | Path) -> int:
    """The build-time contamination gate: raise if `prompts` overlap any prompt under
    `benchmark_dir`; returns how many benchmark prompts were checked."""
    texts = load_benchmark_prompts(benchmark_dir)
    check_no_overlap(prompts, texts)
    return len(texts)
