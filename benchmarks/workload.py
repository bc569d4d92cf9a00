"""Deterministic structured-extraction workloads shipped with the repository.

Each item is a document of roughly 150-400 tokens (SmolLM2 tokenizer) built from a seeded
random generator, a JSON Schema, and the chat messages asking the model to extract the
schema's fields from the document. The answers are spans of the document (names, dates,
cities, amounts), so the workload is copy-heavy like real extraction; ``invention_items`` is
the opposite (the answer is not in the prompt), for measuring speculation with no copying;
``person_items`` are one-sentence chat requests of about 40 tokens (name, age, city), the
interactive case that ``bench latency`` and the peers comparison time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST = ["Ada", "Grace", "Alan", "Katherine", "Linus", "Margaret", "Edsger", "Barbara", "Donald", "Frances",
         "Tim", "Radia", "Ken", "Sophie", "Yukihiro", "Hedy", "Dennis", "Shafi", "Niklaus", "Lynn"]
LAST = ["Lovelace", "Hopper", "Turing", "Johnson", "Torvalds", "Hamilton", "Dijkstra", "Liskov", "Knuth",
        "Allen", "Berners-Lee", "Perlman", "Thompson", "Wilson", "Matsumoto", "Lamarr", "Ritchie",
        "Goldwasser", "Wirth", "Conway"]
CITIES = ["Lisbon", "Osaka", "Nairobi", "Toronto", "Wellington", "Reykjavik", "Montevideo", "Tallinn",
          "Porto Alegre", "Kraków", "Hanoi", "Marseille", "Adelaide", "Bergen", "Cusco", "Ljubljana"]
COMPANIES = ["Northwind Traders", "Blue Harbor Labs", "Quantum Orchard", "Redwood Analytics",
             "Silverline Freight", "Copper Kettle Foods", "Aurora Robotics", "Granite Peak Energy"]
PRODUCTS = ["solar inverter", "espresso grinder", "field microscope", "cargo bicycle", "3D printer",
            "weather station", "drone battery", "network switch"]
FILLER = [
    "The meeting notes were circulated to every team on the following morning.",
    "Several attendees asked for the slides, which were shared in the usual folder.",
    "Weather conditions were mild, and the venue reported no delays at the entrance.",
    "A short review of last quarter's results preceded the main discussion.",
    "The catering arrived early and the coffee was, by all accounts, excellent.",
    "Questions about the budget were deferred to the finance committee.",
    "Minutes were taken by the office of the secretary and approved without changes.",
    "Parking near the building was limited, so most people arrived by tram.",
    "The agenda also covered the upcoming audit and the new travel policy.",
    "Everyone agreed that the next session should start thirty minutes earlier.",
    "An archive copy of this memo is kept in the records room on the second floor.",
    "Further details are available from the coordinator upon request.",
    "The translation of the handbook into three languages is now complete.",
    "A fire drill is scheduled for the second Tuesday of next month.",
    "Volunteers for the charity run should sign up at the front desk.",
    "The new badge readers will be installed over the long weekend.",
    "Printer paper is once again available in the supply cabinet.",
    "Feedback on the pilot programme was positive but cautious.",
    "The library will extend its opening hours during the exam period.",
    "Two interns from the local university will join the team in autumn.",
    "Old laptops must be returned to the IT service before the end of the year.",
    "The kitchen on the third floor is closed for renovation until further notice.",
    "A reminder: expense reports are due on the fifth working day of each month.",
    "The quarterly newsletter will feature interviews with three long-serving staff.",
]

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "email": {"type": "string", "format": "email"},
    },
    "required": ["name", "age", "city", "email"],
    "additionalProperties": False,
}
INVOICE_SCHEMA = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{5}$"},
        "customer": {"type": "string", "maxLength": 40},
        "date": {"type": "string", "format": "date"},
        "total": {"type": "number"},
        "currency": {"enum": ["EUR", "USD", "JPY", "GBP"]},
    },
    "required": ["invoice_number", "customer", "date", "total", "currency"],
    "additionalProperties": False,
}
EVENT_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 30},
        "date": {"type": "string", "format": "date"},
        "speakers": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 1, "maxItems": 3},
    },
    "required": ["title", "city", "date", "speakers"],
    "additionalProperties": False,
}
SHIPMENT_SCHEMA = {
    "type": "object",
    "properties": {
        "tracking_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{8}$"},
        "product": {"type": "string", "maxLength": 40},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
        "origin": {"type": "string", "maxLength": 30},
        "destination": {"type": "string", "maxLength": 30},
    },
    "required": ["tracking_id", "product", "quantity", "origin", "destination"],
    "additionalProperties": False,
}


PERSON_SHORT_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}
PERSON_SENTENCES = [
    "{name} is {age} years old and lives in {city}.",
    "{name}, aged {age}, lives in {city}.",
    "{first} {last} lives in {city} and turned {age} this year.",
    "Born {age} years ago, {name} now lives in {city}.",
    "{name} ({age}) has lived in {city} for a long time.",
    "Our new neighbour in {city} is {name}; {first} is {age}.",
]
PERSON_INSTRUCTION = "Extract the name, age and city of the person as JSON."


@dataclass(slots=True)
class WorkItem:
    """One extraction request and its known answer.

    Attributes:
        kind: what is extracted ("person", "invoice", ...).
        document: the text the facts are planted in.
        schema: the JSON Schema of the answer.
        answer: the planted facts, field by field (what a correct extraction returns); empty
            for items with no right answer (``invention_items``).
        instruction: a system message asking for the answer; ``None``: the fixed extraction
            system message and a user message naming the fields.
    """

    kind: str
    document: str
    schema: dict
    answer: dict
    instruction: str | None = None

    def messages(self) -> list[dict]:
        if self.instruction is not None:
            return [{"role": "system", "content": self.instruction}, {"role": "user", "content": self.document}]
        return [
            {"role": "system", "content": "You extract facts from documents and answer with JSON only."},
            {"role": "user", "content": f"Document:\n{self.document}\n\nExtract the {self.kind} described in the "
                                        f"document as JSON with the fields: {', '.join(self.schema['properties'])}."},
        ]


def _date(rng: random.Random) -> str:
    return f"{rng.randrange(2015, 2027)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"


def _name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def _pad(rng: random.Random, facts: list[str], n_filler: int) -> str:
    sentences = facts + rng.sample(FILLER, k=min(n_filler, len(FILLER)))
    head, rest = sentences[0], sentences[1:]
    rng.shuffle(rest)
    return " ".join([head] + rest)


def _person(rng: random.Random) -> WorkItem:
    name, city, age = _name(rng), rng.choice(CITIES), rng.randrange(19, 90)
    email = f"{name.split()[0].lower()}.{rng.randrange(10, 99)}@{rng.choice(['example.org', 'mail.test'])}"
    facts = [f"This memo concerns {name}, who joined the regional committee this spring.",
             f"{name.split()[0]} is {age} years old and lives in {city}.",
             f"Correspondence should be sent to {email} rather than the old postal address."]
    return WorkItem("person", _pad(rng, facts, rng.randrange(9, 22)), PERSON_SCHEMA,
                    {"name": name, "age": age, "city": city, "email": email})


def _invoice(rng: random.Random) -> WorkItem:
    number = f"INV-{rng.randrange(10000, 99999)}"
    customer, date = rng.choice(COMPANIES), _date(rng)
    total, currency = round(rng.uniform(50, 20000), 2), rng.choice(["EUR", "USD", "JPY", "GBP"])
    facts = [f"Invoice {number} was issued to {customer} on {date}.",
             f"The amount due is {total} {currency}, payable within thirty days.",
             f"Please quote {number} with every payment."]
    return WorkItem("invoice", _pad(rng, facts, rng.randrange(9, 22)), INVOICE_SCHEMA,
                    {"invoice_number": number, "customer": customer, "date": date, "total": total,
                     "currency": currency})


def _event(rng: random.Random) -> WorkItem:
    title = f"{rng.choice(['Summit on', 'Workshop on', 'Forum for'])} {rng.choice(['Open Data', 'Quiet Computing', 'Urban Rail', 'Soil Health', 'Tiny Models'])}"
    city, date = rng.choice(CITIES), _date(rng)
    speakers = [_name(rng) for _ in range(rng.randrange(1, 4))]
    facts = [f"The {title} will take place in {city} on {date}.",
             f"Confirmed speakers: {', '.join(speakers)}.",
             "Registration opens two weeks before the event."]
    return WorkItem("event", _pad(rng, facts, rng.randrange(9, 22)), EVENT_SCHEMA,
                    {"title": title, "city": city, "date": date, "speakers": speakers})


def _shipment(rng: random.Random) -> WorkItem:
    tracking = f"{rng.choice(['DX', 'UP', 'FE', 'LP'])}{rng.randrange(10_000_000, 99_999_999)}"
    product, qty = rng.choice(PRODUCTS), rng.randrange(1, 500)
    origin, dest = rng.sample(CITIES, 2)
    facts = [f"Shipment {tracking} left the warehouse in {origin} yesterday.",
             f"It contains {qty} units of {product} bound for {dest}.",
             f"Track it with the code {tracking} on the carrier's site."]
    return WorkItem("shipment", _pad(rng, facts, rng.randrange(9, 22)), SHIPMENT_SCHEMA,
                    {"tracking_id": tracking, "product": product, "quantity": qty, "origin": origin,
                     "destination": dest})


KINDS = [_person, _invoice, _event, _shipment]


def extraction_items(n: int, seed: int = 0) -> list[WorkItem]:
    """``n`` copy-heavy extraction items (documents ~150-400 tokens), deterministic in ``seed``."""
    rng = random.Random(seed)
    return [KINDS[i % len(KINDS)](rng) for i in range(n)]


def person_items(n: int, seed: int = 0) -> list[WorkItem]:
    """``n`` one-sentence person extractions (about 40 prompt tokens with SmolLM2's template:
    a system instruction, one sentence), schema name/age/city; deterministic in ``seed``."""
    rng = random.Random(seed + 104729)
    items = []
    for i in range(n):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        name, age, city = f"{first} {last}", rng.randrange(19, 90), rng.choice(CITIES)
        sentence = PERSON_SENTENCES[i % len(PERSON_SENTENCES)].format(name=name, first=first, last=last,
                                                                       age=age, city=city)
        items.append(WorkItem("person", sentence, PERSON_SHORT_SCHEMA, {"name": name, "age": age, "city": city},
                              instruction=PERSON_INSTRUCTION))
    return items


def invention_items(n: int, seed: int = 0) -> list[WorkItem]:
    """``n`` items whose answer is not in the prompt (no copying): invent a fictional person."""
    rng = random.Random(seed + 7919)
    items = []
    for _ in range(n):
        theme = rng.choice(["a lighthouse keeper", "a jazz pianist", "a marine biologist", "a baker",
                            "a chess coach", "a train conductor", "a beekeeper", "a glassblower"])
        items.append(WorkItem("person", f"Invent a fictional {theme} with a name, age, home city and email.",
                              PERSON_SCHEMA, {}))
    return items


def shared_system_prompt(n_tokens_approx: int = 1000, seed: int = 0) -> str:
    """A long, fixed system prompt (~``n_tokens_approx`` tokens) for the prefix-caching scenario."""
    rng = random.Random(seed)
    parts = ["You are a careful assistant for a logistics company. Follow the policies below."]
    i = 1
    while len(" ".join(parts)) < n_tokens_approx * 5:  # ~5 characters per token in this prose
        parts.append(f"Policy {i}: {rng.choice(FILLER)} {rng.choice(FILLER)}")
        i += 1
    return " ".join(parts)
