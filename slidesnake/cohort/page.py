"""results/cohort.html: the page a pathologist opens, one file that works offline.

Its style, script and the cohort's three pictures (the QC contact sheet, the embedding
maps, the slide-feature projection) are inside it; each slide's own pictures are linked
(relative to results/) as lazily loaded thumbnails, so the page stays a few MB at 10,000
slides. The table is data the script draws, 500 rows at a time (10,000 rows of thumbnails
are more than a browser lays out quickly): it sorts by any column and filters by status,
text and model; the filters and the order are kept in the address
(`cohort.html#status=failed`, `#sort=-tiles`) and applied on load, so a link can point
at the failures.
"""

from __future__ import annotations

import base64
import json
import math
import time
from html import escape
from pathlib import Path

import pandas as pd

from slidesnake.cohort.gallery import EMBEDDING_MAP, QC_PICTURES

# The cohort's pictures, shown inline in this order, with their captions.
COHORT_PICTURES = {
    "cohort_gallery.jpg": "QC contact sheet: the failed slides first, then a spread of the rest",
    "embedding_maps.jpg": "Embedding maps: each slide's tiles coloured by their embeddings",
    "slide_features_pca.png": "Slide features: the cohort's slides on their first two components",
}
# Above this median share of a job spent waiting for tiles, the reader held the model up.
READER_BOUND = 0.2
MIME = {".jpg": "image/jpeg", ".png": "image/png"}


def cohort_page(
    table: pd.DataFrame,
    results: Path,
    pictures: dict[str, Path],
    finished: bool = True,
    written: float | None = None,
) -> str:
    """The page of `table` (a cohort table, results/cohort.tsv's), with `pictures` (the
    names of COHORT_PICTURES to the files holding them now, in that order) inline."""
    rows = [_row(record, results) for record in table.to_dict("records")]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(written or time.time()))
    state = "the run had finished" if finished else "the run was still going"
    return _PAGE.format(
        headline=headline(table),
        written=f"Written {stamp}; {state}.",
        failures=_failures(table),
        pictures="".join(_figure(name, pictures[name]) for name in pictures),
        rows=json.dumps(rows).replace("</", "<\\/"),
        columns=json.dumps(_columns(table)),
        script=_SCRIPT,
    )


def headline(table: pd.DataFrame) -> str:
    """The cohort in one line of figures: how far, how fast, and what held it up."""
    counts = table["status"].value_counts()
    unit = "slide-model pairs" if "model" in table else "slides"
    done = table[table["status"] == "done"]
    tiles, seconds = int(done["tiles"].sum()), float(done["wall_s"].sum())
    parts = [f"<b>{counts.get('done', 0)}</b> of {len(table)} {unit} done",
             f"<b>{counts.get('failed', 0)}</b> failed",
             f"<b>{len(table) - counts.get('done', 0) - counts.get('failed', 0)}</b> not yet run",
             f"<b>{tiles:,}</b> tiles"]  # fmt: skip
    if seconds > 0:
        parts.append(f"<b>{tiles / seconds:,.0f}</b> tiles/s embedding")
    wait = done["loader_wait_fraction"].median() if len(done) else math.nan
    if not math.isnan(wait):
        bound = "the reader" if wait > READER_BOUND else "the GPU (the model)"
        bound = f"{bound} was the bottleneck"
        parts.append(f"median loader wait <b>{wait:.0%}</b> of a job: {bound}")
    return " · ".join(parts)


# The table's headings, where a column's name is not one.
HEADINGS = {"slide_id": "slide", "wall_s": "seconds", "tiles_per_s": "tiles/s",
            "loader_wait_fraction": "loader wait", "model_busy_fraction": "device busy",
            "dropped_pen": "dropped (pen)", "dropped_focus": "dropped (focus)",
            "model_s": "model seconds", "model_tiles_per_s": "model tiles/s"}  # fmt: skip


def _columns(table: pd.DataFrame) -> list[list[str]]:
    """[column, heading] of the columns that hold anything, the reason last: it is long."""
    kept = [c for c in table.columns if c != "reason" and table[c].notna().any()]
    return [[c, HEADINGS.get(c, c)] for c in [*kept, "reason"]]


def _row(record: dict, results: Path) -> dict:
    """A table row as the script reads it: no NaN, and the slide's pictures on disk."""
    row = {k: None if v is pd.NA or v != v else v for k, v in record.items()}  # NaN != NaN
    folder = results / "slides" / str(row["slide_id"])
    model = str(row.get("model") or "")
    names = [*QC_PICTURES, f"{model}/{EMBEDDING_MAP}" if model else EMBEDDING_MAP]
    row["pictures"] = [name for name in names if (folder / name).is_file()]
    return row


def _failures(table: pd.DataFrame) -> str:
    failed = table[table["status"] == "failed"]
    if failed.empty:
        return "<p>No slide failed.</p>"
    items = "".join(
        f"<li><b>{escape(str(row.slide_id))}</b>"
        + (f" ({escape(str(row.model))})" if "model" in failed else "")
        + f": {escape(str(row.reason))}</li>"
        for row in failed.itertuples()
    )
    link = '<p><a href="#status=failed">Only these in the table</a></p>'
    return f'<ul class="failures">{items}</ul>{link}'


def _figure(name: str, path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    source = f"data:{MIME[Path(name).suffix]};base64,{data}"
    caption = f"<figcaption>{COHORT_PICTURES[name]}</figcaption>"
    return f'<figure><img src="{source}" alt="{name}">{caption}</figure>'


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>slidesnake cohort</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
.headline {{ font-size: 1.1em; }} .written {{ color: #666; }}
.failures li {{ margin: 0.3em 0; }} .failures b {{ color: #b01e1e; }}
figure {{ display: inline-block; margin: 0 1em 1em 0; vertical-align: top; }}
figure img {{ max-width: 30vw; max-height: 40vh; border: 1px solid #ddd; }}
figcaption {{ color: #555; font-size: 0.9em; max-width: 30vw; }}
.filters {{ margin: 1em 0; }} .filters > * {{ margin-right: 0.8em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th {{ cursor: pointer; background: #f3f3f3; position: sticky; top: 0; }}
th, td {{ padding: 0.25em 0.6em; border-bottom: 1px solid #e4e4e4; text-align: right; }}
td.text, th.text {{ text-align: left; }}
tr.failed td {{ background: #fdecec; }} tr.running td {{ background: #eef4fd; }}
td.pictures {{ white-space: nowrap; text-align: left; }}
td img {{ width: 86px; height: 64px; object-fit: contain; margin-right: 2px; }}
</style></head>
<body>
<h1>Cohort</h1>
<p class="headline">{headline}</p>
<p class="written">{written}</p>
<h2>Failed</h2>
{failures}
<h2>Pictures</h2>
{pictures}
<h2>Slides</h2>
<div class="filters">
<label>Status <select id="status"><option value="">all</option><option>failed</option>
<option>running</option><option>pending</option><option>done</option></select></label>
<label>Text <input id="text" type="search" placeholder="slide or reason"></label>
<label id="model-filter">Model <select id="model"><option value="">all</option></select></label>
<span id="shown"></span>
</div>
<table id="slides"><thead></thead><tbody></tbody></table>
<p><button id="more" hidden>Show more</button></p>
<script type="application/json" id="rows">{rows}</script>
<script type="application/json" id="columns">{columns}</script>
<script>{script}</script>
</body></html>
"""

_SCRIPT = """
"use strict";
window.addEventListener("error", (e) => {
  document.body.dataset.errors = (document.body.dataset.errors || "") + e.message + "\\n";
});
const rows = JSON.parse(document.getElementById("rows").textContent);
const columns = JSON.parse(document.getElementById("columns").textContent);
const text = new Set(["slide_id", "model", "status", "reason"]);
const filters = ["status", "text", "model"].map((id) => document.getElementById(id));
let order = { column: null, up: true };
const PAGE_ROWS = 500;
let limit = PAGE_ROWS;

function esc(value) {
  return String(value).replace(/[&<>"']/g, (c) => "&#" + c.charCodeAt(0) + ";");
}
function cell(row, column) {
  const value = row[column];
  if (value === null || value === undefined) return "";
  if (typeof value === "number" && !Number.isInteger(value)) return value.toPrecision(3);
  return esc(value);
}
function pictures(row) {
  const base = "slides/" + encodeURIComponent(row.slide_id) + "/";
  return row.pictures.map((name) => {
    const href = base + name.split("/").map(encodeURIComponent).join("/");
    const img = '<img loading="lazy" width="86" height="64" src="' + href + '" alt="' +
      esc(name) + '">';
    return '<a href="' + href + '">' + img + "</a>";
  }).join("");
}
function matches(row) {
  const [status, words, model] = filters.map((f) => f.value.trim());
  if (status && row.status !== status) return false;
  if (model && String(row.model) !== model) return false;
  const haystack = (row.slide_id + " " + (row.reason || "")).toLowerCase();
  return !words || haystack.includes(words.toLowerCase());
}
function sorted(shown) {
  const c = order.column;
  if (c === null) return shown;
  const key = (row) => row[c] === null ? -Infinity : row[c];
  const sign = order.up ? 1 : -1;
  return shown.slice().sort((a, b) => (key(a) < key(b) ? -sign : key(a) > key(b) ? sign : 0));
}
function render() {
  const matching = sorted(rows.filter(matches));
  const shown = matching.slice(0, limit);
  document.querySelector("#slides tbody").innerHTML = shown.map((row) =>
    '<tr class="' + esc(row.status) + '">' + columns.map(([c]) =>
      '<td class="' + (text.has(c) ? "text" : "") + '">' + cell(row, c) + "</td>").join("") +
    '<td class="pictures">' + pictures(row) + "</td></tr>").join("");
  document.getElementById("shown").textContent = matching.length + " of " + rows.length +
    " rows" + (matching.length > limit ? ", the first " + limit + " shown" : "");
  document.getElementById("more").hidden = matching.length <= limit;
  const hash = new URLSearchParams();
  filters.forEach((f) => { if (f.value) hash.set(f.id, f.value); });
  if (order.column !== null) hash.set("sort", (order.up ? "" : "-") + order.column);
  history.replaceState(null, "", hash.toString() ? "#" + hash : location.pathname);
}
function header() {
  document.querySelector("#slides thead").innerHTML = "<tr>" + columns.map(([c, heading]) =>
    '<th class="' + (text.has(c) ? "text" : "") + '" data-column="' + c + '">' + esc(heading) +
    "</th>").join("") + '<th class="text">pictures</th></tr>';
  document.querySelectorAll("th[data-column]").forEach((th) => th.addEventListener("click", () => {
    const c = th.dataset.column;
    order = { column: c, up: order.column === c ? !order.up : true };
    render();
  }));
}
function fromAddress() {
  const hash = new URLSearchParams(location.hash.slice(1));
  filters.forEach((f) => { if (hash.has(f.id)) f.value = hash.get(f.id); });
  const sort = hash.get("sort") || "";
  const column = sort.replace(/^-/, "");
  if (columns.some(([c]) => c === column)) order = { column, up: !sort.startsWith("-") };
}
const models = [...new Set(rows.map((row) => row.model).filter((m) => m))];
const modelFilter = document.getElementById("model");
models.forEach((m) => modelFilter.add(new Option(m, m)));
if (!models.length) document.getElementById("model-filter").hidden = true;
header();
fromAddress();
filters.forEach((f) => f.addEventListener("input", () => { limit = PAGE_ROWS; render(); }));
document.getElementById("more").addEventListener("click", () => { limit += PAGE_ROWS; render(); });
window.addEventListener("hashchange", () => { fromAddress(); render(); });
render();
document.body.dataset.ready = "yes";
document.body.dataset.readyMs = Math.round(performance.now());
"""
