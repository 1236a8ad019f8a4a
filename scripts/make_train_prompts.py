"""Compose the chat and code training prompts of specdec/data/train/ from the hand-written lists below.

    python scripts/make_train_prompts.py [--out specdec/data/train] [--seed 20261130]

Drafters are trained by self-distillation: the target answers these prompts and the drafter learns
the answers, so the prompts only need to be broad and varied, not answered. Every prompt is a task
template (written here) applied to a topic or programming subject (written here), with the
template's free choices (audience, number, tone, language...) drawn from one seeded random stream,
so the same seed writes the same files byte for byte. No benchmark or test set was read to write
these lists; tests/test_train_prompts.py proves the outputs share no question with them.
"""

from __future__ import annotations

import argparse
import json
import os
import random

SEED = 20261130
NUM_CHAT = 4000
NUM_CODE = 2500
NUM_FUNCTIONS = 5000
OUT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "specdec", "data", "train"))

# --- chat: topics by field (pairs within a field are compared) ---------------------------------------

TOPICS = {
    "science": ["photosynthesis", "black holes", "plate tectonics", "the water cycle", "DNA replication",
                "vaccines", "the greenhouse effect", "quantum entanglement", "evolution by natural selection",
                "the periodic table", "ocean tides", "static electricity", "the immune system", "volcanoes",
                "solar eclipses", "antibiotic resistance", "the speed of light", "coral reefs", "earthquakes",
                "the human microbiome", "nuclear fusion", "rainbows", "magnetism", "cell division"],
    "history": ["the printing press", "the Roman Republic", "the Silk Road", "the Industrial Revolution",
                "the fall of the Berlin Wall", "ancient Egyptian pyramids", "the Renaissance", "the Magna Carta",
                "the Apollo moon landings", "the Ottoman Empire", "the invention of the telephone",
                "the Viking age", "the Meiji Restoration", "the abolition of slavery", "the Black Death",
                "the Inca road system", "the first Olympic Games", "the history of paper money"],
    "cooking": ["sourdough bread", "risotto", "knife skills", "fermenting vegetables", "making fresh pasta",
                "roasting a chicken", "vegetarian curries", "baking cookies", "stir-frying", "homemade stock",
                "seasoning a cast-iron pan", "meal prepping for a week", "spice blends", "making pancakes",
                "cooking rice perfectly", "salad dressings"],
    "travel": ["backpacking on a budget", "travelling by night train", "packing a carry-on bag",
               "visiting Kyoto", "a weekend in Lisbon", "hiking in the Alps", "road trips with children",
               "jet lag", "travel insurance", "learning phrases before a trip", "visiting national parks",
               "travelling solo", "camping in the desert", "a city break in Prague"],
    "programming": ["recursion", "version control with git", "unit testing", "object-oriented programming",
                    "hash tables", "APIs", "databases and indexes", "regular expressions", "garbage collection",
                    "concurrency and threads", "Big-O notation", "code reviews", "open-source software",
                    "compilers and interpreters", "caching", "continuous integration", "type systems",
                    "functional programming"],
    "health": ["getting better sleep", "strength training for beginners", "staying hydrated", "stretching",
               "managing stress", "a balanced diet", "walking every day", "posture at a desk",
               "mindfulness meditation", "reducing screen time", "healthy snacks", "running a first 5K"],
    "finance": ["compound interest", "building an emergency fund", "index funds", "budgeting with the 50/30/20 rule",
                "paying off credit card debt", "inflation", "saving for retirement", "how credit scores work",
                "renting versus buying a home", "diversification", "starting a small business", "tracking expenses"],
    "writing": ["writing a cover letter", "overcoming writer's block", "keeping a journal", "editing your own work",
                "writing dialogue", "persuasive essays", "writing clear instructions", "telling a story with a twist",
                "writing a speech", "note-taking"],
    "nature": ["honeybees", "migrating birds", "old-growth forests", "octopuses", "wetlands", "mushrooms",
               "desert plants", "wolves", "monarch butterflies", "the Arctic tundra", "composting"],
    "arts": ["impressionist painting", "learning the guitar", "jazz improvisation", "photography composition",
             "origami", "film editing", "writing haiku", "ballet", "pottery", "street art", "choir singing"],
    "everyday": ["decluttering a home", "houseplants", "time management", "learning a new language",
                 "public speaking", "making friends as an adult", "remote work", "cycling to work",
                 "adopting a dog", "organising a birthday party", "recycling", "repairing a bicycle tyre",
                 "negotiating a salary", "planning a vegetable garden"],
    "technology": ["electric cars", "solar panels", "smartphones", "3D printing", "the internet",
                   "password managers", "machine learning", "robot vacuum cleaners", "GPS navigation",
                   "cloud storage", "wind turbines", "e-readers"],
}

AUDIENCES = {"a ten-year-old": "ten-year-olds", "a complete beginner": "complete beginners",
             "a busy manager": "busy managers", "a high-school student": "high-school students",
             "my grandmother": "grandparents", "a curious teenager": "curious teenagers",
             "someone who speaks English as a second language": "adult English learners",
             "a university student": "university students"}
TONES = ["friendly", "formal", "enthusiastic", "calm", "humorous", "concise"]
FORMS = ["a short poem", "a limerick", "a haiku sequence", "a four-line rhyme", "a short free-verse poem"]
PEOPLE = ["a tour guide", "a museum curator", "a ship's captain", "a patient teacher", "a medieval innkeeper",
          "a detective", "a park ranger", "a friendly robot", "a radio host", "a librarian"]
RECIPIENTS = ["my landlord", "a colleague", "my team", "a customer", "my neighbour", "a teacher", "a hiring manager"]
EMAIL_PURPOSES = ["to ask for a meeting about {t}", "to share a short update on {t}", "to invite them to a talk on {t}",
                  "to ask for advice about {t}", "to thank them for their help with {t}",
                  "to propose a small workshop on {t}"]

# paragraph templates for the summarise tasks: sentences about a topic (written here, generic on purpose)
PARA = [
    "{T} has interested people for a long time, and for good reason.",
    "At first glance {t} looks simple, but there is more to it than most people expect.",
    "Experts often point out that the basics of {t} can be learned in an afternoon.",
    "Mastering {t}, on the other hand, can take years of practice and curiosity.",
    "Many people first meet {t} at school, where it is usually taught as a list of facts.",
    "A better way in is to ask why {t} matters in everyday life.",
    "Some of the most common mistakes come from skipping the fundamentals.",
    "Books, videos and local groups all make it easier to start.",
    "In recent years, interest in {t} has grown as more resources appear online.",
    "Critics argue that much of what is written about {t} is oversimplified.",
    "Still, even a little knowledge of {t} can change how you see the world around you.",
    "Those who keep at it usually say the effort was worth it.",
]

# chat task types: each a few phrasings; {t} a topic, {u} a second topic of the same field, {T} capitalised
CHAT_TASKS = [
    ["Explain {t} to {aud}.", "Can you explain {t} in simple terms for {aud}?", "How would you explain {t} to {aud}?"],
    ["Write {form} about {t}.", "Compose {form} inspired by {t}."],
    ["Give {n} practical tips for {t}.", "What are {n} tips someone should know about {t}?"],
    ["Compare {t} and {u}.", "What are the main similarities and differences between {t} and {u}?"],
    ["Write a {tone} email to {rcpt} {purpose}.", "Draft a short, {tone} email to {rcpt} {purpose}."],
    ["Pretend you are {person}. Tell me about {t}.", "Roleplay as {person} and introduce {t} to a visitor."],
    ["Summarise the following paragraph in one sentence:\n\n{para}", "Summarize this text in {n} bullet points:\n\n{para}",
     "Read the paragraph below and give its main idea.\n\n{para}"],
    ["Brainstorm {n} ideas related to {t}.", "List {n} creative project ideas involving {t}."],
    ["Give me step-by-step instructions for getting started with {t}.", "How do I get started with {t}? Go step by step."],
    ["What are the pros and cons of {t}?", "List the advantages and disadvantages of {t}."],
    ["Write a short story in which {t} plays a central role.", "Tell a bedtime story that teaches a child about {t}."],
    ["What are {n} common misconceptions about {t}?", "Which myths about {t} do people often believe?"],
    ["Write a short quiz with {n} questions about {t}, with answers.", "Make {n} flashcards about {t}."],
    ["Why does {t} matter?", "Why should an ordinary person care about {t}?"],
    ["Write a {tone} social media post about {t}.", "Write a catchy headline and a two-sentence teaser about {t}."],
    ["Give a one-paragraph overview of {t}.", "Describe {t} in about 100 words."],
    ["What questions should I ask an expert on {t}?", "I am interviewing an expert on {t}. Suggest {n} questions."],
    ["Create a one-week learning plan for {t}.", "Plan a 30-day challenge around {t}."],
    ["Explain {t} using an analogy.", "Come up with a good metaphor that explains {t}."],
    ["Write a dialogue between two friends discussing {t}.", "Write a short conversation where a student asks a teacher about {t}."],
    ["What is the history behind {t}?", "How has our understanding of {t} changed over time?"],
    ["Give {n} fun facts about {t}.", "Tell me something surprising about {t}."],
    ["Write a product description for a beginner's kit about {t}.", "Write an advert for an evening class on {t}."],
    ["Write a {tone} speech of about 150 words about {t}.", "Write an opening paragraph for a talk on {t}."],
    ["What are the first {n} things a beginner should learn about {t}?", "Outline the key concepts of {t}."],
    ["Argue for and against spending more time on {t}.", "Write a short debate between someone who loves {t} and a sceptic."],
    ["Explain {t} in exactly three sentences.", "Explain {t} without using any technical words."],
    ["Write a diary entry from someone discovering {t} for the first time.", "Write a letter to your future self about {t}."],
    ["What would the world be like without {t}?", "Imagine {t} had never existed. What might be different?"],
    ["Write a riddle whose answer is related to {t}.", "Write a tongue twister about {t}."],
    ["Create an outline for a blog post on {t}.", "Suggest {n} titles for an article about {t}."],
    ["How would you teach {t} to a group of {aud_plural}?", "Design a 45-minute lesson about {t}."],
    ["What mistakes do beginners make with {t}, and how can they avoid them?", "What should I avoid when learning about {t}?"],
    ["Rewrite this sentence to sound more {tone}: \"I want to learn more about {t} soon.\"",
     "Make this sentence clearer: \"{T}, which many people are interested in, is something that can be learned.\""],
    ["Write a haiku about {t}, then explain the imagery you used.", "Write a song chorus about {t}."],
    ["Which books, podcasts or activities would help me learn about {t}?", "Recommend ways to learn about {t} for free."],
    ["Summarise what {aud} should know about {t} in {n} bullet points.", "Give me a cheat sheet on {t}."],
    ["How is {t} connected to {u}?", "Write a paragraph linking {t} and {u}."],
    ["Answer as a {tone} assistant: what is {t}?", "In a {tone} tone, describe {t}."],
    ["Give an example of {t} from everyday life.", "Where might I encounter {t} in daily life?"],
    ["Write a thank-you note to someone who taught you about {t}.", "Write a toast celebrating {t}."],
    ["Create a checklist for {t}.", "Make a to-do list for someone who wants to improve at {t}."],
    ["What are the ethical questions around {t}?", "Are there any risks connected with {t}? Explain briefly."],
    ["Write a short news report about a new discovery related to {t}.", "Write a fictional interview with an expert on {t}."],
]

# --- code ---------------------------------------------------------------------------------------------

# (name, arguments, what it returns or does): the Python functions the code tasks are about
FUNCS = [
    ("reverse_words", "s: str", "returns the words of `s` in reverse order, separated by single spaces"),
    ("is_palindrome", "s: str", "returns True if `s` reads the same forwards and backwards, ignoring case and non-letters"),
    ("count_vowels", "s: str", "returns the number of vowels in `s`"),
    ("flatten", "nested: list", "flattens an arbitrarily nested list of lists into a flat list"),
    ("chunk", "items: list, size: int", "splits `items` into consecutive lists of length `size` (the last may be shorter)"),
    ("merge_dicts", "a: dict, b: dict", "merges two dictionaries, summing the values of keys present in both"),
    ("word_frequencies", "text: str", "returns a dict mapping each lower-cased word of `text` to its count"),
    ("second_largest", "nums: list[int]", "returns the second largest distinct number in `nums`, or None if there is none"),
    ("rotate_list", "items: list, k: int", "rotates `items` to the right by `k` positions"),
    ("binary_search", "items: list[int], target: int", "returns the index of `target` in the sorted list `items`, or -1"),
    ("fibonacci", "n: int", "returns the n-th Fibonacci number (fibonacci(0) == 0)"),
    ("factorial", "n: int", "returns n! and raises ValueError for negative n"),
    ("gcd", "a: int, b: int", "returns the greatest common divisor of `a` and `b` using Euclid's algorithm"),
    ("is_prime", "n: int", "returns True if `n` is a prime number"),
    ("primes_up_to", "n: int", "returns all primes <= n using the sieve of Eratosthenes"),
    ("caesar_cipher", "text: str, shift: int", "shifts every letter of `text` by `shift` places, keeping case and non-letters"),
    ("run_length_encode", "s: str", "compresses `s` as character-count pairs, e.g. 'aaab' -> 'a3b1'"),
    ("anagrams", "a: str, b: str", "returns True if `a` and `b` are anagrams of each other, ignoring spaces and case"),
    ("unique_in_order", "items: list", "removes duplicates from `items` while keeping the first occurrence order"),
    ("transpose", "matrix: list[list[int]]", "returns the transpose of a rectangular matrix"),
    ("matrix_multiply", "a: list[list[float]], b: list[list[float]]", "multiplies two matrices given as lists of rows"),
    ("digit_sum", "n: int", "returns the sum of the decimal digits of `n` (negative numbers allowed)"),
    ("to_binary", "n: int", "returns the binary representation of a non-negative integer as a string, without built-ins"),
    ("roman_to_int", "s: str", "converts a Roman numeral such as 'MCMXCIV' to an integer"),
    ("int_to_roman", "n: int", "converts an integer from 1 to 3999 to a Roman numeral"),
    ("valid_parentheses", "s: str", "returns True if the brackets ()[]{} in `s` are balanced and properly nested"),
    ("longest_common_prefix", "words: list[str]", "returns the longest prefix shared by all strings in `words`"),
    ("group_by_length", "words: list[str]", "returns a dict mapping each word length to the list of words with that length"),
    ("moving_average", "values: list[float], window: int", "returns the list of averages of each `window` consecutive values"),
    ("capitalize_words", "s: str", "capitalises the first letter of every word in `s`"),
    ("snake_to_camel", "name: str", "converts a snake_case identifier to camelCase"),
    ("camel_to_snake", "name: str", "converts a camelCase identifier to snake_case"),
    ("merge_sorted", "a: list[int], b: list[int]", "merges two sorted lists into one sorted list in linear time"),
    ("bubble_sort", "items: list[int]", "sorts `items` with bubble sort and returns a new list"),
    ("insertion_sort", "items: list[int]", "sorts `items` with insertion sort and returns a new list"),
    ("merge_sort", "items: list[int]", "sorts `items` with merge sort and returns a new list"),
    ("quick_sort", "items: list[int]", "sorts `items` with quicksort and returns a new list"),
    ("count_inversions", "items: list[int]", "returns the number of pairs i < j with items[i] > items[j]"),
    ("max_subarray_sum", "nums: list[int]", "returns the largest sum of a non-empty contiguous subarray (Kadane's algorithm)"),
    ("two_sum_indices", "nums: list[int], target: int", "returns indices of two different elements adding up to `target`, or None"),
    ("power_set", "items: list", "returns every subset of `items` as a list of lists"),
    ("permutations_of", "s: str", "returns all distinct permutations of the characters of `s`"),
    ("hanoi_moves", "n: int", "returns the list of (from, to) moves solving the Towers of Hanoi for `n` disks"),
    ("pascal_row", "n: int", "returns row `n` of Pascal's triangle as a list"),
    ("celsius_to_fahrenheit", "c: float", "converts a temperature from Celsius to Fahrenheit"),
    ("leap_year", "year: int", "returns True if `year` is a leap year in the Gregorian calendar"),
    ("days_between", "d1: str, d2: str", "returns the number of days between two dates given as 'YYYY-MM-DD'"),
    ("parse_key_values", "line: str", "parses 'a=1;b=2' into {'a': '1', 'b': '2'}, ignoring empty parts"),
    ("invert_dict", "d: dict", "returns a dict mapping each value of `d` to the list of keys that had it"),
    ("deep_get", "d: dict, path: str", "returns the value at a dotted path like 'a.b.c' in nested dicts, or None"),
    ("most_common_char", "s: str", "returns the most frequent character of `s` (the earliest one on ties)"),
    ("truncate_text", "text: str, width: int", "shortens `text` to at most `width` characters, ending with '...' when cut"),
    ("wrap_text", "text: str, width: int", "wraps `text` into lines of at most `width` characters without splitting words"),
    ("histogram", "values: list[int]", "returns a text histogram with one line of '*' per distinct value"),
    ("median", "nums: list[float]", "returns the median of a non-empty list of numbers"),
    ("standard_deviation", "nums: list[float]", "returns the population standard deviation of `nums`"),
    ("normalize", "nums: list[float]", "scales `nums` linearly so the minimum becomes 0 and the maximum 1"),
    ("dedupe_emails", "emails: list[str]", "removes duplicate e-mail addresses, comparing them case-insensitively"),
    ("is_valid_ipv4", "s: str", "returns True if `s` is a valid dotted IPv4 address"),
    ("count_words_in_file", "path: str", "returns the number of words in the text file at `path`"),
    ("read_csv_column", "path: str, column: str", "returns the values of one named column of a CSV file as a list of strings"),
    ("sum_nested", "data: list", "returns the sum of all numbers in an arbitrarily nested list, using recursion"),
    ("depth_of", "nested: list", "returns the maximum nesting depth of a list (a flat list has depth 1)"),
    ("collatz_steps", "n: int", "returns how many steps the Collatz process takes to reach 1 from `n`"),
    ("perfect_numbers", "limit: int", "returns all perfect numbers below `limit`"),
    ("spiral_order", "matrix: list[list[int]]", "returns the elements of a matrix in clockwise spiral order"),
    ("find_duplicates", "items: list", "returns the elements that appear more than once, in order of first repeat"),
    ("balance_after", "transactions: list[tuple[str, float]]", "applies ('deposit'|'withdraw', amount) pairs to a zero balance and returns it"),
]

# functions for the docstring-stub prompts (name, args, return annotation, what it does); written by hand for this
# set, none taken from a benchmark
MORE_FUNCS = [
    ("interleave", "a: list, b: list", "list", "returns the elements of `a` and `b` alternately, the rest of the longer list at the end"),
    ("pairwise_differences", "nums: list[int]", "list[int]", "returns the differences between each element and the one before it"),
    ("running_total", "nums: list[float]", "list[float]", "returns the cumulative sums of `nums`"),
    ("count_runs", "items: list", "int", "returns the number of maximal runs of equal consecutive elements"),
    ("longest_run", "items: list", "int", "returns the length of the longest run of equal consecutive elements (0 for an empty list)"),
    ("split_on_value", "items: list, sep", "list[list]", "splits `items` into the sublists between occurrences of `sep`"),
    ("index_all", "items: list, value", "list[int]", "returns every index at which `value` occurs in `items`"),
    ("zip_longest_fill", "a: list, b: list, fill", "list[tuple]", "pairs up `a` and `b`, padding the shorter one with `fill`"),
    ("top_n", "scores: dict[str, int], n: int", "list[str]", "returns the `n` keys with the highest scores, highest first, ties broken alphabetically"),
    ("group_consecutive", "nums: list[int]", "list[list[int]]", "groups a sorted list into runs of consecutive integers"),
    ("ranges_to_string", "nums: list[int]", "str", "describes a sorted list of integers compactly, e.g. [1, 2, 3, 7, 9, 10] -> '1-3,7,9-10'"),
    ("expand_ranges", "spec: str", "list[int]", "expands a string such as '1-3,7,9-10' into the list of integers it names"),
    ("dedupe_keep_last", "items: list", "list", "removes duplicates, keeping the last occurrence of each element in its place"),
    ("partition_by", "items: list[int], pivot: int", "tuple[list[int], list[int]]", "splits `items` into the elements below `pivot` and the rest, keeping their order"),
    ("every_nth", "items: list, n: int, offset: int = 0", "list", "returns every `n`-th element of `items` starting at `offset`"),
    ("sliding_max", "nums: list[int], k: int", "list[int]", "returns the maximum of every window of `k` consecutive numbers"),
    ("majority_element", "items: list", "object", "returns the element that occurs in more than half of `items`, or None when there is none"),
    ("flatten_dict", "d: dict, sep: str = '.'", "dict", "flattens nested dictionaries into one level, joining the keys with `sep`"),
    ("unflatten_dict", "d: dict, sep: str = '.'", "dict", "turns keys such as 'a.b.c' back into nested dictionaries"),
    ("diff_dicts", "old: dict, new: dict", "dict", "returns the keys added, removed and changed between two dictionaries, as three sorted lists"),
    ("count_by", "items: list, key", "dict", "returns how many items give each value of the function `key`"),
    ("pick", "d: dict, keys: list", "dict", "returns a new dictionary with only the given keys that `d` has"),
    ("merge_intervals", "intervals: list[tuple[int, int]]", "list[tuple[int, int]]", "merges overlapping closed intervals and returns them sorted"),
    ("interval_overlap", "a: tuple[int, int], b: tuple[int, int]", "int", "returns the length of the overlap of two closed intervals (0 when they do not meet)"),
    ("free_slots", "busy: list[tuple[int, int]], start: int, end: int", "list[tuple[int, int]]", "returns the gaps between the busy intervals inside [start, end]"),
    ("title_case", "s: str", "str", "capitalises every word of `s` except short words such as 'a', 'of' and 'the' (the first word always)"),
    ("slugify", "title: str", "str", "turns a title into a lower-case URL slug of letters, digits and single hyphens"),
    ("kebab_to_snake", "name: str", "str", "converts a kebab-case name to snake_case"),
    ("count_substring", "text: str, sub: str", "int", "counts the non-overlapping occurrences of `sub` in `text`"),
    ("longest_word", "sentence: str", "str", "returns the longest word of `sentence`, the first one on ties, ignoring punctuation"),
    ("initials", "full_name: str", "str", "returns the upper-case initials of a name, e.g. 'ada king lovelace' -> 'AKL'"),
    ("mask_email", "email: str", "str", "hides the middle of the part before '@', keeping its first and last character"),
    ("mask_card", "number: str", "str", "replaces all but the last four digits of a card number with '*', keeping spaces"),
    ("is_isogram", "word: str", "bool", "returns True if no letter occurs twice in `word`, ignoring case, spaces and hyphens"),
    ("is_pangram", "sentence: str", "bool", "returns True if `sentence` uses every letter of the English alphabet"),
    ("char_positions", "s: str", "dict[str, list[int]]", "maps each character of `s` to the list of positions where it occurs"),
    ("compress_spaces", "text: str", "str", "replaces every run of whitespace in `text` with one space and trims both ends"),
    ("center_text", "text: str, width: int, fill: str = ' '", "str", "centres `text` in a field of `width` characters, the extra fill on the right"),
    ("dedent_lines", "lines: list[str]", "list[str]", "removes the indentation that all non-blank lines share"),
    ("parse_duration", "s: str", "int", "converts a duration such as '1h30m15s' into seconds"),
    ("format_duration", "seconds: int", "str", "formats seconds as a human string such as '2 hours, 5 minutes and 1 second'"),
    ("parse_query_string", "query: str", "dict[str, list[str]]", "parses 'a=1&b=2&a=3' into {'a': ['1', '3'], 'b': ['2']}"),
    ("build_query_string", "params: dict[str, str]", "str", "joins parameters into 'key=value' pairs separated by '&', keys sorted"),
    ("parse_semver", "version: str", "tuple[int, int, int]", "parses a version such as '2.10.3' into a tuple of three integers"),
    ("compare_versions", "a: str, b: str", "int", "compares two dotted version strings and returns -1, 0 or 1"),
    ("parse_ini", "text: str", "dict[str, dict[str, str]]", "parses a simple INI text with [sections] and key = value lines"),
    ("csv_line", "line: str", "list[str]", "splits one CSV line into fields, honouring double-quoted fields that contain commas"),
    ("tokenize_expression", "expr: str", "list[str]", "splits an arithmetic expression into numbers, operators and parentheses"),
    ("evaluate_rpn", "tokens: list[str]", "float", "evaluates an expression in reverse Polish notation with + - * /"),
    ("to_rpn", "expr: str", "list[str]", "converts an infix arithmetic expression to reverse Polish notation (shunting-yard)"),
    ("hex_to_rgb", "color: str", "tuple[int, int, int]", "converts a colour such as '#1a2b3c' or '1a2b3c' to an (r, g, b) tuple"),
    ("rgb_to_hex", "r: int, g: int, b: int", "str", "formats a colour as '#rrggbb', clamping each channel to 0..255"),
    ("bytes_to_human", "n: int", "str", "formats a byte count with the largest fitting unit, e.g. 1536 -> '1.5 KiB'"),
    ("luhn_valid", "number: str", "bool", "returns True if the digits of `number` pass the Luhn checksum"),
    ("isbn10_valid", "isbn: str", "bool", "returns True if `isbn` is a valid ISBN-10 (hyphens allowed, 'X' as the last digit)"),
    ("digital_root", "n: int", "int", "adds the digits of `n` repeatedly until one digit remains"),
    ("reverse_integer", "n: int", "int", "reverses the decimal digits of `n`, keeping its sign"),
    ("is_armstrong", "n: int", "bool", "returns True if `n` equals the sum of its digits each raised to the number of digits"),
    ("lcm_of_list", "nums: list[int]", "int", "returns the least common multiple of a list of positive integers"),
    ("prime_factors", "n: int", "dict[int, int]", "returns the prime factorisation of `n` as a dict from prime to exponent"),
    ("divisors", "n: int", "list[int]", "returns all positive divisors of `n` in increasing order"),
    ("nth_triangular", "n: int", "int", "returns the n-th triangular number"),
    ("is_power_of_two", "n: int", "bool", "returns True if `n` is a positive power of two, using bit operations"),
    ("count_set_bits", "n: int", "int", "returns the number of 1 bits in a non-negative integer"),
    ("gray_code", "n: int", "list[int]", "returns the n-bit Gray code sequence"),
    ("base_convert", "digits: str, from_base: int, to_base: int", "str", "converts a number written in one base (2..36) to another"),
    ("binomial", "n: int, k: int", "int", "returns n choose k without computing large factorials"),
    ("catalan", "n: int", "int", "returns the n-th Catalan number"),
    ("newton_sqrt", "x: float, tol: float = 1e-10", "float", "approximates the square root of `x` with Newton's method"),
    ("integrate_trapezoid", "f, a: float, b: float, n: int", "float", "approximates the integral of `f` over [a, b] with `n` trapezoids"),
    ("solve_quadratic", "a: float, b: float, c: float", "list[float]", "returns the real roots of a x^2 + b x + c = 0 in increasing order"),
    ("dot_product", "u: list[float], v: list[float]", "float", "returns the dot product of two vectors of equal length"),
    ("vector_angle", "u: list[float], v: list[float]", "float", "returns the angle between two vectors in degrees"),
    ("polygon_area", "points: list[tuple[float, float]]", "float", "returns the area of a simple polygon given by its vertices in order (shoelace formula)"),
    ("point_in_rectangle", "p: tuple[float, float], rect: tuple[float, float, float, float]", "bool", "returns True if point `p` lies inside the rectangle (x, y, width, height), edges included"),
    ("distance_2d", "a: tuple[float, float], b: tuple[float, float]", "float", "returns the Euclidean distance between two points"),
    ("closest_pair", "points: list[tuple[float, float]]", "tuple", "returns the two points that are closest to each other"),
    ("manhattan_path", "start: tuple[int, int], end: tuple[int, int]", "list[tuple[int, int]]", "returns the grid cells of a path that first moves along x, then along y"),
    ("rotate_matrix", "m: list[list[int]]", "list[list[int]]", "rotates a square matrix 90 degrees clockwise"),
    ("matrix_diagonals", "m: list[list[int]]", "tuple[int, int]", "returns the sums of the main and the anti-diagonal of a square matrix"),
    ("count_islands", "grid: list[list[int]]", "int", "counts the groups of 1s connected horizontally or vertically"),
    ("flood_fill", "grid: list[list[int]], row: int, col: int, color: int", "list[list[int]]", "repaints the region connected to (row, col) with `color`"),
    ("shortest_path_grid", "grid: list[str]", "int", "returns the fewest steps from 'S' to 'E' through '.' cells, or -1 (breadth-first search)"),
    ("topological_order", "deps: dict[str, list[str]]", "list[str]", "orders tasks so that each comes after the tasks it depends on, raising ValueError on a cycle"),
    ("has_cycle", "graph: dict[int, list[int]]", "bool", "returns True if a directed graph has a cycle"),
    ("connected_components", "edges: list[tuple[int, int]]", "list[set[int]]", "returns the connected components of an undirected graph"),
    ("dijkstra", "graph: dict[str, dict[str, float]], source: str", "dict[str, float]", "returns the shortest distance from `source` to every reachable node"),
    ("edit_distance", "a: str, b: str", "int", "returns the Levenshtein distance between two strings"),
    ("longest_common_subsequence", "a: str, b: str", "str", "returns one longest common subsequence of two strings"),
    ("longest_increasing_run", "nums: list[int]", "list[int]", "returns the longest strictly increasing contiguous slice of `nums`"),
    ("coin_change_ways", "amount: int, coins: list[int]", "int", "returns the number of ways to make `amount` from unlimited coins of the given values"),
    ("min_coins", "amount: int, coins: list[int]", "int", "returns the fewest coins that make `amount`, or -1 if it cannot be made"),
    ("knapsack", "items: list[tuple[int, int]], capacity: int", "int", "returns the best total value of (weight, value) items that fit in `capacity`"),
    ("stairs_ways", "n: int, steps: list[int]", "int", "returns how many ways there are to climb `n` stairs taking the given step sizes"),
    ("word_break", "s: str, words: set[str]", "bool", "returns True if `s` can be split into a sequence of words from `words`"),
    ("balanced_split", "nums: list[int]", "bool", "returns True if `nums` can be split into two groups of equal sum"),
    ("rle_decode", "s: str", "str", "expands a run-length code such as 'a3b1c2' into 'aaabcc'"),
    ("vigenere_encrypt", "text: str, key: str", "str", "encrypts the letters of `text` with the Vigenere cipher, keeping case and other characters"),
    ("atbash", "text: str", "str", "encodes `text` with the Atbash cipher (a<->z, b<->y, ...), keeping case"),
    ("morse_encode", "text: str", "str", "translates letters and digits into Morse code, letters separated by spaces and words by ' / '"),
    ("checksum_mod256", "data: bytes", "int", "returns the sum of the bytes of `data` modulo 256"),
    ("parse_log_line", "line: str", "dict", "parses '2024-05-01 12:00:03 ERROR disk full' into date, time, level and message"),
    ("count_levels", "lines: list[str]", "dict[str, int]", "counts the log lines of each level (INFO, WARNING, ERROR, ...)"),
    ("tail_lines", "path: str, n: int", "list[str]", "returns the last `n` lines of a text file without reading it all into memory"),
    ("find_files", "root: str, suffix: str", "list[str]", "returns the paths of all files under `root` whose names end with `suffix`, sorted"),
    ("safe_divide", "a: float, b: float, default: float = 0.0", "float", "returns a / b, or `default` when b is zero"),
    ("clamp", "x: float, low: float, high: float", "float", "limits `x` to the range [low, high]"),
    ("lerp", "a: float, b: float, t: float", "float", "interpolates linearly between `a` and `b` at fraction `t`"),
    ("percent_change", "old: float, new: float", "float", "returns the change from `old` to `new` in percent, rounded to two decimals"),
    ("weighted_mean", "values: list[float], weights: list[float]", "float", "returns the weighted average of `values`"),
    ("mode_of", "values: list", "list", "returns the most frequent values, all of them when several tie, in first-seen order"),
    ("percentile", "values: list[float], p: float", "float", "returns the p-th percentile of `values` with linear interpolation"),
    ("zscores", "values: list[float]", "list[float]", "returns how many standard deviations each value lies from the mean"),
    ("bin_values", "values: list[float], edges: list[float]", "list[int]", "counts how many values fall into each bin between consecutive edges"),
    ("compound_interest", "principal: float, rate: float, years: int, per_year: int = 12", "float", "returns the balance after compounding `per_year` times a year"),
    ("loan_payment", "principal: float, annual_rate: float, months: int", "float", "returns the fixed monthly payment of an amortised loan"),
    ("split_bill", "total: float, people: int", "list[float]", "splits a bill into shares in cents that add up exactly to the total"),
    ("change_breakdown", "cents: int", "dict[int, int]", "returns how many of each coin (100, 50, 20, 10, 5, 2, 1 cents) make the amount with the fewest coins"),
    ("day_of_year", "date: str", "int", "returns the day of the year (1..366) of a 'YYYY-MM-DD' date without the datetime module"),
    ("add_business_days", "date: str, days: int", "str", "returns the date `days` working days after a 'YYYY-MM-DD' date, skipping weekends"),
    ("week_number", "date: str", "int", "returns the ISO week number of a 'YYYY-MM-DD' date"),
    ("time_to_minutes", "hhmm: str", "int", "converts '13:45' to minutes after midnight"),
    ("overlapping_meetings", "meetings: list[tuple[str, str]]", "bool", "returns True if any two ('HH:MM', 'HH:MM') meetings overlap"),
    ("tic_tac_toe_winner", "board: list[str]", "str", "returns 'X', 'O' or '' for a board of three strings of three characters"),
    ("valid_sudoku_row", "row: list[int]", "bool", "returns True if a sudoku row holds each of 1..9 exactly once"),
    ("dice_probability", "total: int, dice: int", "float", "returns the probability of rolling `total` with `dice` six-sided dice"),
    ("shuffle_deck", "seed: int", "list[str]", "returns a 52-card deck such as 'AS', '10H' shuffled with a seeded random generator"),
    ("bowling_score", "rolls: list[int]", "int", "returns the score of a complete ten-pin bowling game"),
    ("next_generation", "grid: list[list[int]]", "list[list[int]]", "returns the next state of Conway's Game of Life on a finite grid"),
    ("lru_get_put", "capacity: int, ops: list[tuple]", "list", "simulates an LRU cache over ('get', k) and ('put', k, v) operations and returns the results of the gets"),
    ("rate_limiter", "timestamps: list[float], limit: int, window: float", "list[bool]", "returns for each request time whether it is allowed, at most `limit` per `window` seconds"),
    ("retry_call", "fn, attempts: int, delay: float", "object", "calls `fn` until it succeeds, at most `attempts` times, sleeping `delay` seconds between tries"),
    ("memoize", "fn", "object", "returns a wrapper that caches the results of `fn` by its positional arguments"),
    ("chunks_of_text", "text: str, max_chars: int", "list[str]", "splits text into pieces of at most `max_chars` characters at sentence ends where possible"),
    ("jaccard", "a: set, b: set", "float", "returns the Jaccard similarity of two sets (1.0 for two empty sets)"),
    ("cosine_similarity", "u: list[float], v: list[float]", "float", "returns the cosine similarity of two vectors"),
    ("hamming", "a: str, b: str", "int", "returns the number of positions where two equal-length strings differ, raising ValueError otherwise"),
    ("soundex", "name: str", "str", "returns the four-character Soundex code of a surname"),
    ("bigrams", "words: list[str]", "dict[tuple[str, str], int]", "counts the pairs of consecutive words"),
    ("ngram_counts", "text: str, n: int", "dict[str, int]", "counts the character n-grams of `text`"),
]

# the function set's stubs: a signature and docstring in a code block, the reply writes the body
DOC_TASKS = [
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{stub}```",
    "Complete the following Python function:\n```python\n{stub}```",
    "Implement the function below, keeping its signature.\n```python\n{stub}```",
    "Fill in the body of this function so that it does what its docstring says:\n```python\n{stub}```",
    "```python\n{stub}```\nWrite the code for this function and explain it briefly.",
    "Here is a function stub with its docstring. Write a correct implementation and a few tests for it.\n```python\n{stub}```",
]

LANGS = ["JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "C#", "Ruby", "Kotlin"]

FUNC_TASKS = [
    "Write a Python function `{name}({args})` that {spec}.",
    "Implement `{name}({args})` in Python. It {spec}. Include a docstring and type hints.",
    "Write a Python function called `{name}` that takes `{args}` and {spec}. Add a few example calls.",
    "Using Python, create a function named `{name}` that {spec}. Explain how it works.",
    "Write `{name}({args})` in Python, which {spec}, without importing any modules.",
    "Write pytest tests for a Python function `{name}({args})` that {spec}. Cover the edge cases.",
    "Write unittest test cases for `{name}({args})`, a function that {spec}.",
    "Write a function in {lang} that {spec}.",
    "Translate this idea into {lang}: a function `{name}` that {spec}.",
    "What is the time and space complexity of a good implementation of `{name}({args})`, which {spec}? Show the code.",
    "Write two versions of `{name}({args})`, which {spec}: a straightforward one and a faster or shorter one. Compare them.",
    "Write a Python function `{name}({args})` that {spec}. Validate the inputs and raise a clear exception for bad ones.",
    "Write a docstring (Google style) for a function `{name}({args})` that {spec}, then implement it.",
    "I need a helper `{name}({args})` that {spec}. Write it and show its output on two examples.",
    "Explain, step by step, how you would design a function that {spec}, then write it in Python as `{name}`.",
    "Write `{name}({args})` in Python using only a loop (no comprehensions), where the function {spec}.",
    "Write a Python command-line script around a function `{name}` that {spec}; read the input from the command line arguments.",
    "Write the Python function `{name}({args})`, which {spec}, and add doctests to its docstring.",
    "Write a short Python module with `{name}({args})`, a function that {spec}, and a `__main__` block that demonstrates it.",
    "Give a test-driven development walkthrough for `{name}({args})`, which {spec}: first the tests, then the code.",
    "Write `{name}({args})` in Python so that it {spec}, then explain which edge cases it handles.",
    "Write a Python function `{name}({args})` that {spec}. Then rewrite it in a more functional style.",
    "Here is a specification: `{name}({args})` {spec}. Write the implementation and three assert statements that check it.",
    "Write a function that {spec}, in both Python and {lang}, and point out the differences.",
    "How would you write a function `{name}` that {spec} in {lang}? Show idiomatic code.",
    "Write a property-based test with Hypothesis for `{name}({args})`, which {spec}.",
    "Write a Python function `{name}({args})` that {spec}, and time it with timeit on a large input.",
    "Please code `{name}({args})`: it {spec}. Keep it short and readable.",
    "Write a Python function `{name}({args})` that {spec}. Then list inputs that could break a naive implementation.",
    "Write a type-annotated Python function `{name}({args})` that {spec}, with a comment explaining each step.",
]

# buggy snippets: (code, what it should do); the fix/explain/review tasks show the code as given
SNIPPETS = [
    ("def average(nums):\n    total = 0\n    for n in nums:\n        total += n\n    return total / len(nums) - 1",
     "return the average of a list of numbers"),
    ("def last_item(items):\n    return items[len(items)]", "return the last element of a list"),
    ("def count_words(text):\n    counts = {}\n    for word in text.split():\n        counts[word] += 1\n    return counts",
     "count how many times each word appears"),
    ("def is_even(n):\n    return n % 2 == 1", "return True for even numbers"),
    ("def add_item(item, bucket=[]):\n    bucket.append(item)\n    return bucket",
     "return a new list containing only `item` when no bucket is given"),
    ("def reverse(s):\n    out = ''\n    for i in range(len(s)):\n        out += s[i]\n    return out",
     "return the string reversed"),
    ("def find_max(nums):\n    best = 0\n    for n in nums:\n        if n > best:\n            best = n\n    return best",
     "return the largest number, also when every number is negative"),
    ("def remove_odds(nums):\n    for n in nums:\n        if n % 2:\n            nums.remove(n)\n    return nums",
     "remove every odd number from the list"),
    ("def read_lines(path):\n    f = open(path)\n    lines = f.readlines()\n    return [l.strip() for l in lines]",
     "return the stripped lines of a file and close it properly"),
    ("def factorial(n):\n    if n == 0:\n        return 0\n    return n * factorial(n - 1)", "return n factorial"),
    ("def contains(items, x):\n    for item in items:\n        if item == x:\n            return True\n        else:\n            return False",
     "return True if x is anywhere in items"),
    ("def squares(n):\n    return [i * i for i in range(1, n)]", "return the squares of 1 to n inclusive"),
    ("def celsius(f):\n    return f - 32 * 5 / 9", "convert Fahrenheit to Celsius"),
    ("def safe_div(a, b):\n    try:\n        return a / b\n    except:\n        return None",
     "return None only when dividing by zero"),
    ("def merge(a, b):\n    a.update(b)\n    return a", "return a merged dict without changing its arguments"),
    ("def countdown(n):\n    while n > 0:\n        print(n)\n    print('liftoff')", "print n, n-1, ..., 1 and then 'liftoff'"),
    ("def title_case(s):\n    return ' '.join(w[0].upper() + w[1:] for w in s.split(' '))",
     "capitalise each word, also when the text has double spaces"),
    ("def unique(items):\n    return list(set(items))", "remove duplicates while keeping the original order"),
]

SNIPPET_TASKS = [
    "This Python function should {goal}, but it has a bug. Find and fix it:\n\n```python\n{code}\n```",
    "Explain what this Python code does, line by line:\n\n```python\n{code}\n```",
    "Review this code. It is meant to {goal}. What is wrong and how would you improve it?\n\n```python\n{code}\n```",
    "Write a test that exposes the bug in this function (it should {goal}):\n\n```python\n{code}\n```",
    "Why does this code not {goal}? Explain the problem to a beginner.\n\n```python\n{code}\n```",
    "Rewrite this function so that it correctly does what it is meant to ({goal}), and add type hints:\n\n```python\n{code}\n```",
]

# SQL: (table description, request)
SCHEMAS = {
    "employees(id, name, department, salary, hired_on)": [
        "the average salary per department", "the three highest-paid employees", "employees hired in the last 30 days",
        "departments with more than five employees", "each employee's salary compared with their department average"],
    "orders(id, customer_id, total, created_at) and customers(id, name, country)": [
        "the total spent by each customer", "customers who never placed an order", "the number of orders per country",
        "the month with the highest revenue", "each customer's most recent order"],
    "books(id, title, author, year, price)": [
        "all books by one author sorted by year", "the cheapest book of each author", "the number of books per decade",
        "authors with at least three books", "books whose price is above the average price"],
    "students(id, name), courses(id, title) and enrolments(student_id, course_id, grade)": [
        "every student's average grade", "courses with no enrolments", "the best student in each course",
        "students enrolled in more than two courses", "the number of students per course"],
    "page_views(user_id, url, viewed_at)": [
        "daily active users", "the ten most viewed pages", "users who viewed the same page twice on one day",
        "the first page each user viewed", "the number of views per hour of the day"],
}
SQL_TASKS = [
    "Given the table {schema}, write an SQL query for {req}.",
    "Write a SQL query that returns {req}. The tables are {schema}. Explain each clause.",
    "Using {schema}, how would I get {req} in SQL? Mention any index that would help.",
]

SHELL = [
    "count the lines in every .py file under the current directory", "find files larger than 100 MB",
    "delete all .tmp files older than seven days", "show the ten largest directories here",
    "rename every .jpeg file to .jpg", "find which process is listening on port 8080",
    "print the most frequent IP addresses in an access log", "replace 'foo' with 'bar' in all .txt files",
    "list the files changed in the last commit", "compress a directory into a .tar.gz archive",
    "watch a log file and show only lines containing ERROR", "count the unique words in a text file",
    "show disk usage of each mounted filesystem in human-readable form", "download a file and verify its SHA-256",
    "sort a CSV file by its second column numerically", "print lines 20 to 30 of a file",
    "find duplicate files by content", "make every .sh file in a folder executable",
    "list the git branches merged into main", "show the environment variables that contain PATH",
    "extract the third column of a tab-separated file", "kill all processes of one user safely",
    "run a command every five seconds and show its output", "convert a file's line endings from CRLF to LF",
    "print the total size of all .log files",
]
SHELL_TASKS = [
    "Give a shell one-liner to {what}.", "How do I {what} in bash? Explain each part of the command.",
    "Write a small bash script to {what}, with comments.",
]

# small classes: (name, what it models)
CLASSES = [
    ("Stack", "a stack with push, pop, peek and is_empty"), ("Queue", "a FIFO queue built on two stacks"),
    ("BankAccount", "a bank account with deposit, withdraw (no overdraft) and a transaction history"),
    ("Rectangle", "a rectangle with area, perimeter and a method that checks whether it is a square"),
    ("LRUCache", "a least-recently-used cache with get and put and a fixed capacity"),
    ("Matrix", "a small matrix class supporting addition, multiplication and transpose"),
    ("Temperature", "a temperature that can be read and set in Celsius, Fahrenheit and Kelvin"),
    ("TodoList", "a to-do list where tasks can be added, completed, removed and listed"),
    ("Inventory", "a shop inventory that tracks item quantities and refuses to go below zero"),
    ("LinkedList", "a singly linked list with append, prepend, find and delete"),
    ("Vector2D", "a 2-D vector with addition, scalar multiplication, length and dot product"),
    ("Timer", "a context manager that measures how long its block took"),
    ("RateLimiter", "a rate limiter that allows at most N calls per second"),
    ("Graph", "an undirected graph with add_edge, neighbours and breadth-first search"),
    ("PriorityQueue", "a min-priority queue on top of a binary heap"),
    ("Fraction", "a fraction kept in lowest terms with +, -, *, / and comparison"),
]
CLASS_TASKS = [
    "Write a Python class `{name}`: {what}.", "Implement {what} as a Python class named `{name}`, with docstrings.",
    "Write a Python class `{name}` ({what}) and unit tests for it.",
    "Design {what} in {lang}. Call the class `{name}`.",
    "Write `{name}`, {what}, as a Python dataclass where that makes sense, and explain your design choices.",
]

CONCEPTS = [
    "list comprehensions", "generators and yield", "decorators", "closures", "context managers", "the GIL",
    "async and await", "duck typing", "mutable default arguments", "shallow versus deep copies", "*args and **kwargs",
    "exceptions and try/finally", "dataclasses", "type hints", "virtual environments", "lambda functions",
    "iterators", "the `with` statement", "f-strings", "slicing", "dictionary views", "sets and their operations",
    "recursion depth limits", "memoization", "dynamic programming", "two-pointer techniques", "binary search trees",
    "hash collisions", "stable sorting", "tail recursion", "immutability", "dependency injection", "SOLID principles",
    "REST APIs", "SQL joins", "database transactions", "unicode and encodings", "floating-point rounding errors",
    "bit manipulation", "big-O of common list operations", "race conditions", "pure functions",
]
CONCEPT_TASKS = [
    "Explain {c} in Python with a short example.", "When should I use {c}? Give a code example.",
    "What are common mistakes with {c}?", "Explain {c} to someone who knows another programming language.",
    "Write a small program that demonstrates {c}, and comment each step.",
    "Give me an interview question about {c} and answer it.",
]

ALGO = [
    "breadth-first search on a grid", "Dijkstra's shortest path", "topological sort", "the knapsack problem",
    "the longest increasing subsequence", "edit distance between two strings", "detecting a cycle in a linked list",
    "union-find with path compression", "counting islands in a 0/1 grid", "the N-queens puzzle",
    "binary search on the answer", "a trie for prefix search", "the sliding window maximum", "matrix path counting",
    "coin change (fewest coins)",
]
ALGO_TASKS = [
    "Explain {a} and implement it in Python.", "Write a Python solution for {a}, with comments and its complexity.",
    "Walk me through {a} on a small example, then show the code.",
]


def _fill(template: str, rng: random.Random, **kw) -> str:
    """``template`` with its free choices drawn from ``rng`` (each drawn whether used or not, so the
    stream does not depend on which placeholders a template has)."""
    aud = rng.choice(sorted(AUDIENCES))
    choices = {"aud": aud, "aud_plural": AUDIENCES[aud], "tone": rng.choice(TONES), "form": rng.choice(FORMS),
               "person": rng.choice(PEOPLE), "rcpt": rng.choice(RECIPIENTS), "n": rng.choice([3, 4, 5, 6]),
               "lang": rng.choice(LANGS), "purpose": rng.choice(EMAIL_PURPOSES)}
    choices.update(kw)
    choices["purpose"] = choices["purpose"].format(t=kw.get("t", "the project"))
    return template.format(**choices)


def _paragraph(topic: str, rng: random.Random) -> str:
    picks = sorted(rng.sample(range(len(PARA)), 5))
    return " ".join(PARA[i].format(t=topic, T=topic[:1].upper() + topic[1:]) for i in picks)


def chat_prompts(rng: random.Random, n: int) -> list[str]:
    pairs = [(field, t) for field, ts in TOPICS.items() for t in ts]
    cands = [(task, field, t) for task in range(len(CHAT_TASKS)) for field, t in pairs]
    rng.shuffle(cands)
    out: list[str] = []
    seen: set[str] = set()
    for task, field, t in cands:
        if len(out) == n:
            break
        u = rng.choice([x for x in TOPICS[field] if x != t])
        template = rng.choice(CHAT_TASKS[task])
        p = _fill(template, rng, t=t, u=u, T=t[:1].upper() + t[1:], para=_paragraph(t, rng))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def code_prompts(rng: random.Random, n: int) -> list[str]:
    cands: list[tuple[str, dict]] = []
    for name, args, spec in FUNCS:
        cands += [(t, {"name": name, "args": args, "spec": spec}) for t in FUNC_TASKS]
    cands += [(t, {"code": code, "goal": goal}) for code, goal in SNIPPETS for t in SNIPPET_TASKS]
    cands += [(t, {"schema": s, "req": r}) for s, reqs in SCHEMAS.items() for r in reqs for t in SQL_TASKS]
    cands += [(t, {"what": w}) for w in SHELL for t in SHELL_TASKS]
    cands += [(t, {"name": c, "what": w}) for c, w in CLASSES for t in CLASS_TASKS]
    cands += [(t, {"c": c}) for c in CONCEPTS for t in CONCEPT_TASKS]
    cands += [(t, {"a": a}) for a in ALGO for t in ALGO_TASKS]
    return _distinct(cands, rng, n)


def _distinct(cands: list[tuple[str, dict]], rng: random.Random, n: int) -> list[str]:
    """Up to ``n`` distinct prompts: the (template, fields) candidates shuffled, then filled in that order."""
    rng.shuffle(cands)
    out: list[str] = []
    seen: set[str] = set()
    for template, kw in cands:
        if len(out) == n:
            break
        p = _fill(template, rng, **kw)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _stub(name: str, args: str, ret: str | None, spec: str) -> str:
    doc = spec[:1].upper() + spec[1:] + "."
    return f'def {name}({args}){" -> " + ret if ret else ""}:\n    """{doc}\n    """\n'


def function_prompts(rng: random.Random, n: int) -> list[str]:
    """Docstring stubs (DOC_TASKS) of every function, old and new, and the new functions in FUNC_TASKS' phrasings."""
    cands = [(t, {"stub": _stub(name, args, None, spec)}) for name, args, spec in FUNCS for t in DOC_TASKS]
    cands += [(t, {"stub": _stub(name, args, ret, spec)}) for name, args, ret, spec in MORE_FUNCS for t in DOC_TASKS]
    cands += [(t, {"name": name, "args": args, "spec": spec}) for name, args, _, spec in MORE_FUNCS for t in FUNC_TASKS]
    return _distinct(cands, rng, n)


def write_jsonl(path: str, prompts: list[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p}, ensure_ascii=False) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT, help="output folder (default: specdec/data/train)")
    ap.add_argument("--seed", type=int, default=SEED, help=f"random seed (default {SEED}, the shipped files)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    chat = chat_prompts(rng, NUM_CHAT)
    code = code_prompts(rng, NUM_CODE)
    functions = function_prompts(rng, NUM_FUNCTIONS)  # drawn after the others: their files stay as they were
    for what, got, want in (("chat", chat, NUM_CHAT), ("code", code, NUM_CODE), ("function", functions, NUM_FUNCTIONS)):
        if len(got) < want:
            raise SystemExit(f"only {len(got)} distinct {what} prompts for {want} wanted: add topics or tasks")
    os.makedirs(args.out, exist_ok=True)
    write_jsonl(os.path.join(args.out, "chat_prompts.jsonl"), chat)
    write_jsonl(os.path.join(args.out, "code_prompts.jsonl"), code)
    write_jsonl(os.path.join(args.out, "function_prompts.jsonl"), functions)
    print(f"{args.out}: {len(chat)} chat prompts, {len(code)} code prompts, {len(functions)} function prompts "
          f"(seed {args.seed})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
