"""Stop strings found in streamed text in time linear in the text (Aho-Corasick).

`StopMatcher(stops).feed(chunk)` consumes the next piece of text and returns the index (in all
text fed so far) where the first stop string to complete begins, or None. `held` is the length of
the longest tail of the text fed so far that some stop string starts with: text a stream must
hold back because it may still turn into a stop string. Building costs O(total stop length);
each fed character costs O(1) amortised, however many stop strings there are.

When several stop strings complete at the same character, the longest wins (it starts first).
"""

from __future__ import annotations

from collections import deque


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.terminal = [False]
        for s in dict.fromkeys(s for s in stops if s):
            node = 0
            for ch in s:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.terminal.append(False)
                node = nxt
            self.terminal[node] = True
        # fail[n]: the node of the longest proper suffix of n's string that is in the trie;
        # out[n]: length of the longest stop string that ends at n's last character (0: none)
        self.fail = [0] * len(self.goto)
        self.out = [self.depth[n] if self.terminal[n] else 0 for n in range(len(self.goto))]
        queue = deque(self.goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self.goto[node].items():
                f = self.fail[node]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[child] = self.goto[f].get(ch, 0) if self.goto[f].get(ch) != child else 0
                if not self.out[child]:
                    self.out[child] = self.out[self.fail[child]]
                queue.append(child)
        self.state = 0
        self.fed = 0

    @property
    def held(self) -> int:
        return self.depth[self.state]

    def feed(self, chunk: str) -> int | None:
        goto, fail, out = self.goto, self.fail, self.out
        state = self.state
        for i, ch in enumerate(chunk):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if out[state]:
                self.state, self.fed = state, self.fed + i + 1
                return self.fed - out[state]
        self.state = state
        self.fed += len(chunk)
        return None
