"""Compose the maths word problems of specdec/data/train/math_prompts.jsonl from the templates below.

    python scripts/make_math_prompts.py [--out specdec/data/train] [--seed 20261204] [--num 12000]

Why: a DFlash drafter for SmolLM2-135M-Instruct drafts GSM8K *train* questions at tau 3.88 and test
questions at 3.28 (2 CPU cores, 12 prompts each; BENCHMARKS.md, session of 2026-12-04 (fifth)): it knows
the replies to the 7,473 questions it was trained on better than replies in general. More questions of
the same kind, not more replies to the same ones, is what that gap asks for. The target answers these
(asked as GSM8K is: the question and "Please reason step by step ..."), and the drafter learns its answers,
so a question need not be hard or even have a neat answer; it should read like a grade-school word problem
with two to four steps. Every question is one of the templates written here with names, things and numbers
drawn from one seeded random stream (the same seed writes the same file byte for byte). No benchmark or test
set was read to write them; tests/test_train_prompts.py proves the file shares no question with them.
"""

from __future__ import annotations

import argparse
import json
import os
import random

SEED = 20261204
NUM = 12000
OUT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "specdec", "data", "train"))

NAMES = ["Amara", "Ben", "Carlos", "Dana", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Keiko", "Liam",
         "Maya", "Nikolai", "Olga", "Priya", "Quentin", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Ximena",
         "Yusuf", "Zoe", "Aiden", "Bianca", "Chidi", "Delia", "Emeka", "Freya", "Gustavo", "Hana", "Ivan", "Jade",
         "Kofi", "Lena", "Mateo", "Nadia", "Oscar", "Paloma", "Rami", "Sofia", "Tomas", "Uma", "Viktor", "Willa"]
# (singular, plural) things people buy, make, collect or sell
THINGS = [("apple", "apples"), ("pencil", "pencils"), ("notebook", "notebooks"), ("cupcake", "cupcakes"),
          ("marble", "marbles"), ("sticker", "stickers"), ("comic book", "comic books"), ("seashell", "seashells"),
          ("tomato plant", "tomato plants"), ("candle", "candles"), ("bracelet", "bracelets"), ("jar of jam", "jars of jam"),
          ("toy car", "toy cars"), ("postcard", "postcards"), ("loaf of bread", "loaves of bread"), ("scarf", "scarves"),
          ("basket of berries", "baskets of berries"), ("puzzle", "puzzles"), ("flower pot", "flower pots"),
          ("baseball card", "baseball cards"), ("bag of rice", "bags of rice"), ("paperback", "paperbacks"),
          ("birdhouse", "birdhouses"), ("muffin", "muffins"), ("keychain", "keychains"), ("bottle of juice", "bottles of juice"),
          ("ticket", "tickets"), ("painting", "paintings"), ("sandwich", "sandwiches"), ("lemon", "lemons")]
PLACES = ["the market", "the school fair", "the bakery", "the bookshop", "the garden centre", "the craft fair",
          "the corner shop", "the library sale", "the farm stand", "the flea market"]
ANIMALS = [("chicken", "chickens", "eggs"), ("cow", "cows", "litres of milk"), ("bee hive", "bee hives", "jars of honey"),
           ("goat", "goats", "litres of milk"), ("duck", "ducks", "eggs")]
UNITS = [("hour", "hours"), ("day", "days"), ("week", "weeks")]
JOBS = ["walking dogs", "tutoring", "mowing lawns", "babysitting", "washing cars", "delivering newspapers",
        "painting fences", "fixing bikes"]
VEHICLES = [("bus", "buses"), ("van", "vans"), ("boat", "boats"), ("minibus", "minibuses"), ("car", "cars")]
SHAPES = ["garden", "playground", "swimming pool", "classroom floor", "parking lot", "vegetable patch"]


def _pick(rng: random.Random, seq, k: int = 1):
    return rng.sample(seq, k) if k > 1 else rng.choice(seq)


# every template: rng -> question text
def t_buy_and_change(r):
    n, (s, p), price = r.randint(3, 12), _pick(r, THINGS), r.randint(2, 15)
    paid = (n * price // 10 + r.randint(1, 5)) * 10
    return (f"{_pick(r, NAMES)} buys {n} {p} at {_pick(r, PLACES)} for ${price} each. She pays with ${paid}. "
            f"How much change does she get?")


def t_sell_profit(r):
    n, (s, p) = r.randint(10, 60), _pick(r, THINGS)
    cost, price = r.randint(1, 6), r.randint(7, 14)
    return (f"{_pick(r, NAMES)} makes {n} {p} to sell. Each one costs ${cost} to make and sells for ${price}. "
            f"If he sells all of them, how much profit does he make?")


def t_groups(r):
    per, groups, (s, p) = r.randint(3, 12), r.randint(4, 15), _pick(r, THINGS)
    extra = r.randint(1, per - 1)
    return (f"{_pick(r, NAMES)} has {per * groups + extra} {p}. She puts them into boxes of {per}. "
            f"How many full boxes can she make, and how many {p} are left over?")


def t_share(r):
    a, b = _pick(r, NAMES, 2)
    total, (s, p) = r.randint(4, 30) * 6, _pick(r, THINGS)
    return (f"{a} and {b} share {total} {p}. {a} gets twice as many as {b}. How many {p} does each of them get?")


def t_rate_time(r):
    job, rate, (u, us) = _pick(r, JOBS), r.randint(8, 25), UNITS[0]
    h1, h2 = r.randint(2, 6), r.randint(2, 6)
    return (f"{_pick(r, NAMES)} earns ${rate} an {u} {job}. On Saturday she works {h1} {us} and on Sunday "
            f"{h2} {us}. How much does she earn over the weekend?")


def t_weekly_savings(r):
    goal, per = r.randint(12, 60) * 10, r.randint(5, 30)
    have = r.randint(1, 9) * 10
    return (f"{_pick(r, NAMES)} wants to buy a bike that costs ${goal}. He has already saved ${have} and saves "
            f"${per} every week. How many weeks will it take him to have enough money?")


def t_percent_discount(r):
    price, pct, (s, p) = r.randint(4, 40) * 5, _pick(r, [10, 15, 20, 25, 30, 40, 50]), _pick(r, THINGS)
    n = r.randint(2, 5)
    return (f"A {s} normally costs ${price}. During a sale everything is {pct}% off. How much does "
            f"{_pick(r, NAMES)} pay for {n} of them in the sale?")


def t_animals(r):
    (a, ap, prod), n, each, days = _pick(r, ANIMALS), r.randint(3, 20), r.randint(2, 6), r.randint(3, 10)
    used = r.randint(1, n * each // 2)
    return (f"{_pick(r, NAMES)} has {n} {ap}. Each gives {each} {prod} a day. Her family uses {used} {prod} a day "
            f"and she sells the rest. How many {prod} does she sell in {days} days?")


def t_trip(r):
    (v, vp), people, seats = _pick(r, VEHICLES), r.randint(30, 200), r.randint(8, 40)
    return (f"{people} students are going on a school trip. Each {v} holds {seats} students. How many {vp} "
            f"does the school need, and how many empty seats will there be?")


def t_speed(r):
    speed, hours, extra = r.randint(4, 12) * 10, r.randint(2, 6), r.randint(10, 90)
    return (f"A train travels at {speed} kilometres an hour for {hours} hours, then another {extra} kilometres "
            f"at a slower speed. How far does it travel in total?")


def t_area_fence(r):
    shape, w, l = _pick(r, SHAPES), r.randint(4, 30), r.randint(5, 40)
    cost = r.randint(2, 12)
    return (f"A rectangular {shape} is {w} metres wide and {l} metres long. Fencing costs ${cost} a metre. "
            f"How much does it cost to put a fence all the way around it?")


def t_area_tiles(r):
    shape, w, l = _pick(r, SHAPES), r.randint(3, 20), r.randint(3, 20)
    per = r.choice([2, 4, 5, 10])
    return (f"A {shape} measures {w} metres by {l} metres. One box of tiles covers {per} square metres. How many "
            f"boxes are needed to cover it?")


def t_ages(r):
    a, b = _pick(r, NAMES, 2)
    age, diff, years = r.randint(5, 15), r.randint(2, 30), r.randint(2, 10)
    return (f"{a} is {age} years old. {b} is {diff} years older than {a}. How old will {b} be in {years} years, "
            f"and what will the sum of their ages be then?")


def t_pages(r):
    pages, first, per = r.randint(12, 60) * 10, r.randint(10, 60), r.randint(15, 45)
    return (f"{_pick(r, NAMES)} is reading a book with {pages} pages. She read {first} pages on the first day and "
            f"plans to read {per} pages every day after that. How many more days will she need to finish it?")


def t_recipe(r):
    flour, serves = r.randint(2, 6), r.randint(2, 6)
    return (f"A recipe uses {flour} cups of flour to make {serves} servings. {_pick(r, NAMES)} wants to make "
            f"{serves * r.randint(2, 5)} servings. How many cups of flour does he need?")


def t_multi_purchase(r):
    (s1, p1), (s2, p2) = _pick(r, THINGS, 2)
    n1, n2, c1, c2 = r.randint(2, 9), r.randint(2, 9), r.randint(2, 12), r.randint(2, 12)
    return (f"{_pick(r, NAMES)} buys {n1} {p1} for ${c1} each and {n2} {p2} for ${c2} each. How much does she "
            f"spend altogether?")


def t_collect(r):
    (s, p), start, week, gave = _pick(r, THINGS), r.randint(10, 80), r.randint(3, 15), r.randint(5, 20)
    weeks = r.randint(2, 8)
    return (f"{_pick(r, NAMES)} has {start} {p}. Every week he gets {week} more. After {weeks} weeks he gives "
            f"{gave} to a friend. How many {p} does he have now?")


def t_fraction_left(r):
    (s, p), denom = _pick(r, THINGS), _pick(r, [2, 3, 4, 5])
    total = denom * r.randint(4, 20)
    more = r.randint(1, total // denom)
    frac = {2: "half", 3: "a third", 4: "a quarter", 5: "a fifth"}[denom]
    return (f"There are {total} {p} in a basket. {_pick(r, NAMES)} takes {frac} of them, and then "
            f"{_pick(r, NAMES)} takes {more} more. How many {p} are left in the basket?")


def t_time_schedule(r):
    tasks = r.randint(3, 6)
    each, brk = r.randint(10, 45), r.randint(5, 15)
    start = r.randint(7, 10)
    return (f"{_pick(r, NAMES)} starts homework at {start}:00. She has {tasks} subjects, spends {each} minutes on "
            f"each and takes a {brk}-minute break between subjects. At what time does she finish?")


def t_average(r):
    scores = [r.randint(55, 100) for _ in range(r.randint(3, 5))]
    listed = ", ".join(str(s) for s in scores[:-1]) + f" and {scores[-1]}"
    return (f"{_pick(r, NAMES)} scored {listed} on her maths tests. What is her average score?")


def t_average_needed(r):
    n, avg = r.randint(3, 5), r.randint(60, 85)
    return (f"{_pick(r, NAMES)}'s average over {n} tests is {avg}. What score does he need on the next test to "
            f"raise his average to {avg + r.randint(2, 8)}?")


def t_wage_overtime(r):
    rate, hours, over = r.randint(10, 30), 40, r.randint(2, 12)
    return (f"{_pick(r, NAMES)} earns ${rate} an hour for the first {hours} hours of the week and one and a half "
            f"times that for every hour after. Last week he worked {hours + over} hours. How much did he earn?")


def t_water(r):
    cap, rate, used = r.randint(20, 200) * 10, r.randint(5, 40), r.randint(1, 10)
    return (f"A tank holds {cap} litres of water. It fills at {rate} litres a minute while {used} litres a minute "
            f"leak out. Starting empty, how many minutes does it take to fill?")


def t_ratio(r):
    a, b = r.randint(1, 5), r.randint(1, 5)
    total = (a + b) * r.randint(3, 20)
    (s1, p1), (s2, p2) = _pick(r, THINGS, 2)
    return (f"At {_pick(r, PLACES)} the ratio of {p1} to {p2} is {a}:{b}. There are {total} of them in all. "
            f"How many {p1} are there?")


def t_tip(r):
    bill, pct, people = r.randint(20, 150), _pick(r, [10, 15, 18, 20]), r.randint(2, 6)
    return (f"{people} friends eat at a restaurant. The bill is ${bill} and they add a {pct}% tip. They split the "
            f"total equally. How much does each person pay?")


def t_garden_rows(r):
    rows, per, dead = r.randint(4, 15), r.randint(5, 20), r.randint(1, 12)
    p = _pick(r, ["tomato plants", "lettuces", "sunflowers", "carrots", "bean plants", "tulips"])
    return (f"{_pick(r, NAMES)} plants {rows} rows of {p} with {per} in each row. {dead} of them do not grow. "
            f"How many {p} grow?")


def t_stairs(r):
    flights, steps, trips = r.randint(2, 8), r.randint(10, 20), r.randint(2, 6)
    return (f"{_pick(r, NAMES)} lives on a floor that is {flights} flights of stairs up, with {steps} steps in each "
            f"flight. She climbs up and down {trips} times a day. How many steps does she climb up in a week?")


def t_unit_price(r):
    (s, p) = _pick(r, THINGS)
    n1, n2 = r.randint(2, 6), r.randint(8, 20)
    c1 = r.randint(3, 10) * n1
    c2 = r.randint(2, 9) * n2
    return (f"A pack of {n1} {p} costs ${c1} and a pack of {n2} costs ${c2}. Which pack is the better deal per "
            f"{s}, and by how much?")


def t_loan(r):
    cost, down, months = r.randint(20, 120) * 10, r.randint(1, 5) * 50, _pick(r, [4, 5, 6, 8, 10, 12])
    return (f"{_pick(r, NAMES)} buys a laptop for ${cost}. He pays ${down} now and the rest in {months} equal "
            f"monthly payments. How much is each payment?")


def t_consecutive(r):
    start, step, n = r.randint(2, 20), r.randint(2, 10), r.randint(4, 8)
    return (f"{_pick(r, NAMES)} saves ${start} in the first week and each week saves ${step} more than the week "
            f"before. How much has she saved after {n} weeks?")


def t_class(r):
    n, pct = r.randint(4, 12) * 5, _pick(r, [20, 40, 60, 80])
    item, cost = _pick(r, ["a packed lunch", "their own snack", "a water bottle", "a ticket already"]), r.randint(2, 9)
    return (f"There are {n} students in {_pick(r, NAMES)}'s class and {pct}% of them bring {item}. Each of the "
            f"others pays ${cost} for one. How much do they pay in total?")


def t_temperature(r):
    start, drop, hours, rise = r.randint(10, 30), r.randint(1, 4), r.randint(2, 6), r.randint(3, 12)
    return (f"At noon it is {start} degrees. The temperature drops {drop} degrees every hour for {hours} hours, "
            f"then rises {rise} degrees before midnight. What is the temperature at midnight?")


def t_packing(r):
    (s, p), per_bag, bags_per_box, boxes = _pick(r, THINGS), r.randint(4, 12), r.randint(3, 10), r.randint(2, 9)
    return (f"A shop packs {per_bag} {p} in a bag and {bags_per_box} bags in a box. It receives {boxes} boxes. "
            f"How many {p} is that, and how much are they worth at ${r.randint(1, 5)} a {s}?")


TEMPLATES = [t_buy_and_change, t_sell_profit, t_groups, t_share, t_rate_time, t_weekly_savings,
             t_percent_discount, t_animals, t_trip, t_speed, t_area_fence, t_area_tiles, t_ages, t_pages, t_recipe,
             t_multi_purchase, t_collect, t_fraction_left, t_time_schedule, t_average, t_average_needed,
             t_wage_overtime, t_water, t_ratio, t_tip, t_garden_rows, t_stairs, t_unit_price, t_loan,
             t_consecutive, t_class, t_temperature, t_packing]


def make(num: int, seed: int) -> list[str]:
    """``num`` distinct questions, the templates in turn, from one seeded stream."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < num:
        template = TEMPLATES[len(out) % len(TEMPLATES)]
        for _ in range(1000):
            q = template(rng)
            if q not in seen:
                break
        else:
            raise SystemExit(f"{template.__name__}: no new question in 1000 draws; give it more variety or ask fewer")
        seen.add(q)
        out.append(q)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=OUT, help="folder for math_prompts.jsonl")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--num", type=int, default=NUM)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "math_prompts.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8", newline="\n") as fh:
        for q in make(a.num, a.seed):
            fh.write(json.dumps({"question": q}, ensure_ascii=False) + "\n")
    os.replace(path + ".tmp", path)
    print(f"{path}: {a.num} questions from {len(TEMPLATES)} templates")


if __name__ == "__main__":
    main()
