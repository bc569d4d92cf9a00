"""A folder of invoices to one CSV file with ``stencil extract``: number, date, vendor, total, currency.

    stencil serve                                        # in one terminal (the default model)
    python examples/invoices_to_csv.py                   # writes 5 invoices to a new folder, extracts them
    python examples/invoices_to_csv.py --folder my_invoices/ --output invoices.csv
    python examples/invoices_to_csv.py --in-process      # no server: the model is loaded by stencil extract

The command it runs is the one you would type::

    stencil extract --schema invoice.json --input invoices/ --output invoices.csv --csv --url http://127.0.0.1:8000

Each ``.txt`` file is one document (its file name is the row's key); the schema is flat, so ``--csv`` can
write one column a field. A rerun with the same ``--output`` skips the files already there.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

INVOICE_SCHEMA = {
    "type": "object",
    "properties": {
        "number": {"type": "string", "maxLength": 24},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "vendor": {"type": "string", "maxLength": 48},
        "total": {"type": "number"},
        "currency": {"enum": ["EUR", "USD", "GBP", "CHF"]},
    },
    "required": ["number", "date", "vendor", "total", "currency"],
    "additionalProperties": False,
}

VENDORS = [("Nordlicht Office Supplies GmbH", "Hamburg", "EUR"), ("Harbour Line Logistics Ltd", "Bristol", "GBP"),
           ("Alpenblick Print AG", "Bern", "CHF"), ("Cedar & Pine Hardware Inc.", "Portland", "USD"),
           ("Atelier Lumière SARL", "Lyon", "EUR"), ("Bluewater Coffee Roasters LLC", "Austin", "USD")]
ITEMS = [("Toner cartridge, black", 54.90), ("A4 copy paper, 5 reams", 23.50), ("Desk lamp, LED", 39.00),
         ("Freight, pallet rate", 180.00), ("Business cards, 500", 42.00), ("Espresso beans, 1 kg", 18.75),
         ("Wood screws, box of 200", 9.40), ("Banner print, 2 x 1 m", 96.00), ("On-site setup, per hour", 65.00)]


def write_invoices(folder: Path, count: int, seed: int = 0) -> dict[str, dict]:
    """``count`` short invoices as ``invoice-NN.txt`` in ``folder`` (seeded); their true fields by file name."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    truth = {}
    for k in range(1, count + 1):
        vendor, city, currency = rng.choice(VENDORS)
        number = f"INV-2026-{rng.randrange(100, 9999):04d}"
        date = f"2026-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"
        lines, total = [], 0.0
        for name, price in rng.sample(ITEMS, rng.randrange(1, 4)):
            qty = rng.randrange(1, 6)
            total += qty * price
            lines.append(f"  {qty} x {name:<26} {price:>8.2f} {currency} {qty * price:>9.2f} {currency}")
        total = round(total, 2)
        text = "\n".join([f"{vendor}", f"{city}", "", f"INVOICE {number}", f"Date: {date}",
                          "Bill to: Meridian Studio, 12 Quay Street", "", *lines, "",
                          f"Total due: {total:.2f} {currency}", "Payment within 30 days. Thank you!"])
        name = f"invoice-{k:02d}.txt"
        (folder / name).write_text(text + "\n", encoding="utf-8")
        truth[name] = {"number": number, "date": date, "vendor": vendor, "total": total, "currency": currency}
    return truth


def extract(folder: Path, output: Path, schema_path: Path, url: str | None, concurrency: int) -> None:
    """Run ``stencil extract`` on the folder into ``output`` (CSV); exits with its status when it fails."""
    cmd = [sys.executable, "-m", "stencil.service.cli", "extract", "--schema", str(schema_path),
           "--input", str(folder), "--output", str(output), "--csv", "--max-tokens", "96",
           "--concurrency", str(concurrency)]
    if url is not None:
        cmd += ["--url", url]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # the progress bar stays on stderr
    print(p.stdout.strip(), file=sys.stderr)
    if p.returncode != 0:
        raise SystemExit(f"stencil extract exited with {p.returncode}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="Stencil server (default %(default)s)")
    ap.add_argument("--in-process", action="store_true", help="load the default model here instead of --url")
    ap.add_argument("--folder", type=Path, default=None,
                    help="a folder of .txt invoices (default: write --count made-up ones to a new folder)")
    ap.add_argument("--count", type=int, default=5, help="invoices to make up when no --folder is given")
    ap.add_argument("--output", type=Path, default=None, help="the CSV file (default: in a new folder)")
    ap.add_argument("--concurrency", type=int, default=4, help="documents in flight")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="stencil_invoices_"))
    truth = {}
    folder = args.folder
    if folder is None:
        folder = work / "invoices"
        truth = write_invoices(folder, args.count)
    output = args.output or work / "invoices.csv"
    schema_path = work / "invoice.json"
    schema_path.write_text(json.dumps(INVOICE_SCHEMA, indent=1), encoding="utf-8")
    extract(folder, output, schema_path, None if args.in_process else args.url, args.concurrency)

    text = output.read_text(encoding="utf-8")
    print(text, end="")
    if truth:  # made-up invoices: how many fields the model got right
        rows = list(csv.DictReader(text.splitlines()))
        right = 0
        for row in rows:
            t = truth[row["key"]]
            right += sum(row[f] == t[f] for f in ("number", "date", "vendor", "currency"))
            right += _same_number(row["total"], t["total"])
        print(f"{right}/{len(rows) * len(INVOICE_SCHEMA['properties'])} fields as written in the invoices "
              f"({output})", file=sys.stderr)
    return 0


def _same_number(cell: str, value: float) -> bool:
    try:
        return abs(float(cell) - value) < 0.005
    except ValueError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
