"""Prompt templates and value pools for the remap quality harness (``bench/remap.py``).

Three families, each with different values per user:
  fewshot    sentiment classification, 6 examples per prompt drawn from a shared pool;
  translate  a translation template whose long guidelines follow the text (shared text dominates);
  form       a fill-in-the-form record (short values between field names) and a question.
Prompts use SmolLM2's chat markup, as the server's chat template would.
"""

from __future__ import annotations

import random

from policies.remap import Instance, Template

SYS = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n"
END = "<|im_end|>\n<|im_start|>assistant\n"

SENTIMENT = [
    ("I loved every minute of this film.", "positive"), ("The service was slow and rude.", "negative"),
    ("What a fantastic day at the beach!", "positive"), ("My order arrived broken again.", "negative"),
    ("The new update makes everything faster.", "positive"), ("I regret buying this phone.", "negative"),
    ("Our guide was friendly and funny.", "positive"), ("The hotel room smelled terrible.", "negative"),
    ("This recipe turned out perfectly.", "positive"), ("The battery dies after an hour.", "negative"),
    ("Best concert I have ever been to.", "positive"), ("The movie was boring and too long.", "negative"),
    ("The staff went out of their way to help.", "positive"), ("I waited two hours for nothing.", "negative"),
    ("Such a cozy and charming little cafe.", "positive"), ("The instructions were impossible to follow.", "negative"),
    ("My kids adore this game.", "positive"), ("The food was cold and bland.", "negative"),
    ("Great value for the price.", "positive"), ("Customer support never answered.", "negative"),
    ("The view from the top was breathtaking.", "positive"), ("It stopped working after a week.", "negative"),
    ("I would happily buy it again.", "positive"), ("The seats were cramped and dirty.", "negative"),
]
QUERIES = [
    "The flowers in the garden made me smile.", "This laptop keeps crashing every day.",
    "Dinner with friends was wonderful.", "The train was late and overcrowded.",
    "I am thrilled with my new bike.", "The package was lost in the mail.",
    "The teacher explained everything clearly.", "The paint started peeling within days.",
]
SENTENCES = [
    "The weather is nice today.", "My brother lives in a small house near the river.",
    "Please close the door when you leave.", "We are going to the market on Saturday morning.",
    "The children are playing in the park.", "I would like a cup of coffee, please.",
    "She reads a book every evening before bed.", "The museum opens at nine o'clock.",
    "Our neighbours have a very friendly dog.", "He forgot his keys at the office.",
    "The soup needs a little more salt.", "They travelled to Spain last summer.",
]
GUIDELINES = (
    "Guidelines:\n"
    "1. Keep the meaning of the original text exactly; do not add or remove information.\n"
    "2. Keep names of people and places unchanged.\n"
    "3. Use a neutral, polite register suitable for a general audience.\n"
    "4. Keep numbers, dates and times in their original form.\n"
    "5. Keep the punctuation of the original where French allows it.\n"
    "6. Do not explain the translation and do not add notes or alternatives.\n"
    "7. Answer with the French translation only, on a single line.\n"
)
NAMES = ["Alice Martin", "Bob Chen", "Carla Diaz", "David Okafor", "Emma Rossi", "Farid Haddad", "Grace Kim", "Hugo Laurent"]
CITIES = ["Paris", "Tokyo", "Lima", "Nairobi", "Oslo", "Toronto", "Madrid", "Sydney"]
JOBS = ["teacher", "nurse", "software engineer", "baker", "pilot", "architect", "farmer", "journalist"]
FOODS = ["pizza", "sushi", "tacos", "pasta", "curry", "pancakes", "salad", "dumplings"]
QUESTIONS = ["In which city does the customer live?", "What is the customer's occupation?", "What is the customer's favourite food?", "How old is the customer?"]

FEWSHOT_K = 6


def templates() -> dict[str, Template]:
    shots = "".join(f"Message: {{m{i}}}\nLabel: {{l{i}}}\n\n" for i in range(FEWSHOT_K))
    return {
        "fewshot": Template.parse(
            "fewshot",
            SYS + "Classify the sentiment of each message as positive or negative. Answer with one word.\n\n"
            + shots + "Message: {q}\nLabel:" + END,
        ),
        "translate": Template.parse(
            "translate",
            SYS + "Translate the text below into French.\n\nText: {text}\n\n" + GUIDELINES + "\nFrench translation:" + END,
        ),
        "form": Template.parse(
            "form",
            SYS + "Here is a customer record from our database.\n\n"
            "Name: {name}\nAge: {age}\nCity: {city}\nOccupation: {job}\nFavourite food: {food}\n\n"
            "Read the record carefully and answer the question using only the information in the record. "
            "Answer with a few words, without repeating the question.\n\nQuestion: {question}" + END,
        ),
    }


def values(task: str, rng: random.Random) -> dict[str, str]:
    if task == "fewshot":
        shots = rng.sample(SENTIMENT, FEWSHOT_K)
        out = {f"m{i}": m for i, (m, _) in enumerate(shots)} | {f"l{i}": lab for i, (_, lab) in enumerate(shots)}
        return out | {"q": rng.choice(QUERIES)}
    if task == "translate":
        return {"text": rng.choice(SENTENCES)}
    if task == "form":
        return {
            "name": rng.choice(NAMES), "age": str(rng.randint(19, 87)), "city": rng.choice(CITIES),
            "job": rng.choice(JOBS), "food": rng.choice(FOODS), "question": rng.choice(QUESTIONS),
        }
    raise ValueError(task)


def tokenizer_fn(tokenizer):
    """``text -> (ids, char offsets)`` from ONE tokenisation of the whole prompt."""

    def tokenize(text: str):
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    return tokenize


def make_instances(tokenizer, task: str, n: int, seed: int, uid0: int = 0) -> list[Instance]:
    rng = random.Random(f"{task}:{seed}")
    tpl = templates()[task]
    tok = tokenizer_fn(tokenizer)
    return [Instance.build(tpl, values(task, rng), tok, uid=uid0 + i) for i in range(n)]
