#!/usr/bin/env python3
"""A small retrieval service for the `search` tools plugin: BM25 over a corpus it builds.

Not a mock: a real HTTP server (the standard library's) ranking a real corpus with Okapi
BM25 (k1 = 1.5, b = 0.75, idf = ln(1 + (N - df + 0.5) / (df + 0.5)), Lucene's form). The
corpus is generated from a seed, so tests and demos need no download: an atlas of
invented places (country, capital, river, founding year, population, export), one short
document per fact, plus distractors that share words with them.

    python3 scripts/bm25_service.py [--port 8090] [--host 127.0.0.1] [--docs 400] [--seed 0]
    python3 scripts/bm25_service.py --port 0 --print-port   # picks a free port, prints it

Endpoints:
    GET /search?q=TEXT&k=3  ->  {"query": ..., "hits": [{"id", "title", "text", "score"}]}
    GET /doc?id=N           ->  one document
    GET /health             ->  {"docs": N}
Answers bind to 127.0.0.1 unless --host says otherwise. Stops on SIGTERM or Ctrl-C.
"""

import argparse
import json
import math
import random
import re
import sys
import threading
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

SYLLABLES = ["ka", "lo", "mar", "ve", "ri", "ton", "sa", "bel", "dun", "or", "qui", "zen",
             "ha", "mi", "gor", "al", "tes", "nu", "pra", "vel"]
EXPORTS = ["copper", "salt", "wool", "timber", "tea", "glass", "amber", "cotton", "iron", "rice"]


def name(rng, parts):
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def build_corpus(n_docs, seed):
    """Documents of the atlas: six facts per country, in plain sentences."""
    rng = random.Random(seed)
    docs, seen = [], set()
    while len(docs) < n_docs:
        country = name(rng, 3)
        if country in seen:
            continue
        seen.add(country)
        capital, river = name(rng, 2), name(rng, 2)
        year = rng.randint(900, 1900)
        population = rng.randint(2, 90) * 100_000
        export = rng.choice(EXPORTS)
        facts = [
            (f"{country}", f"The capital of {country} is {capital}."),
            (f"{capital}", f"{capital} is a city on the {river} river, the capital of {country}."),
            (f"{country} history", f"{country} was founded in {year}."),
            (f"{country} people", f"{country} has a population of {population:,}."),
            (f"{country} trade", f"The main export of {country} is {export}."),
            (f"{river} river", f"The {river} river flows through {country} past {capital}."),
        ]
        for title, text in facts:
            docs.append({"id": len(docs), "title": title, "text": text})
    return docs[:n_docs]


TOKEN = re.compile(r"[a-z0-9]+")


def tokens(text):
    return TOKEN.findall(text.lower())


class Bm25:
    def __init__(self, docs, k1=1.5, b=0.75):
        self.docs, self.k1, self.b = docs, k1, b
        self.tf = [Counter(tokens(d["title"] + " " + d["text"])) for d in docs]
        self.len = [sum(tf.values()) for tf in self.tf]
        self.avg = sum(self.len) / max(len(docs), 1)
        df = defaultdict(int)
        for tf in self.tf:
            for t in tf:
                df[t] += 1
        n = len(docs)
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}
        self.postings = defaultdict(list)
        for i, tf in enumerate(self.tf):
            for t in tf:
                self.postings[t].append(i)

    def search(self, query, k):
        scores = defaultdict(float)
        for t in set(tokens(query)):
            idf = self.idf.get(t)
            if idf is None:
                continue
            for i in self.postings[t]:
                f = self.tf[i][t]
                norm = f + self.k1 * (1 - self.b + self.b * self.len[i] / self.avg)
                scores[i] += idf * f * (self.k1 + 1) / norm
        best = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        return [dict(self.docs[i], score=round(s, 4)) for i, s in best]


def serve(index, host, port, print_port):
    class Handler(BaseHTTPRequestHandler):
        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            url = urlparse(self.path)
            q = parse_qs(url.query)
            if url.path == "/health":
                return self.reply(200, {"docs": len(index.docs)})
            if url.path == "/search":
                query = q.get("q", [""])[0]
                try:
                    k = max(1, min(int(q.get("k", ["3"])[0]), 20))
                except ValueError:
                    return self.reply(400, {"error": "k must be a number"})
                if not query.strip():
                    return self.reply(400, {"error": "q is empty"})
                return self.reply(200, {"query": query, "hits": index.search(query, k)})
            if url.path == "/doc":
                try:
                    return self.reply(200, index.docs[int(q.get("id", ["-1"])[0])])
                except (ValueError, IndexError):
                    return self.reply(404, {"error": "no such document"})
            return self.reply(404, {"error": f"no endpoint {url.path}"})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    if print_port:
        print(server.server_address[1], flush=True)
    else:
        print(f"bm25: {len(index.docs)} documents on http://{host}:{server.server_address[1]}",
              file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8090)
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--print-port", action="store_true", help="print the bound port on stdout")
    ap.add_argument("--dump", action="store_true", help="print the corpus as JSON lines and exit")
    args = ap.parse_args()
    docs = build_corpus(args.docs, args.seed)
    if args.dump:
        for d in docs:
            print(json.dumps(d))
        return
    serve(Bm25(docs), args.host, args.port, args.print_port)


if __name__ == "__main__":
    main()
