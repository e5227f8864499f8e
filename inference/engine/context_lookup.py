"""Guessing the next tokens from the text so far: what followed the last time its final tokens occurred.

Text repeats itself: answers quote the prompt, code reuses names, small models loop. Where the last n
tokens (n = 3, 2, 1, longest first) occurred before, the tokens that followed them then are a free guess
for what follows now (prompt lookup decoding, here over the prompt and the answer alike). The guess joins
the step's dynamic tree as one chain below the root, scored like the heads' nodes, by how often such
guesses were right: the chain competes with the heads for the tree's nodes instead of taking them.

The index lives on the host, fed with the tokens each step already brings back, so it adds no
device-to-host transfer; updating it costs a few dictionary writes per token.
"""

import math

MAX_MATCH = 3
# How often a guessed token was right, by the length of the match it came from: the first token of a guess,
# and each later one given that the ones before it were right. `train/lookup_accuracy.py` on the demo model's
# greedy answers to the held-out ShareGPT prompts (train/demo_heads/README.md), a split no head was trained on.
FIRST_TOKEN_ACCURACY = {3: 0.84, 2: 0.55, 1: 0.20}
NEXT_TOKEN_ACCURACY = {3: 0.92, 2: 0.73, 1: 0.68}


class ContextLookup:
    """All tokens so far (prompt, then every accepted token) and, for every n-gram of up to MAX_MATCH
    tokens, the position right after its latest occurrence that has a successor."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending just before `token` now have a successor
            for n in range(1, min(MAX_MATCH, end) + 1):
                self._after[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def find(self, count: int) -> tuple[list[int], int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest suffix of the text
        (of at most MAX_MATCH tokens) and that suffix's length; ([], 0) when the last token is new.

        A continuation that runs into the present repeats itself, as a loop would: the guess for a
        position not yet written is the guess already made for the position one period earlier.
        """
        length = len(self.tokens)
        for n in range(min(MAX_MATCH, length), 0, -1):
            start = self._after.get(tuple(self.tokens[length - n :]))
            if start is None:
                continue
            guessed: list[int] = []
            for offset in range(count):
                position = start + offset
                guessed.append(self.tokens[position] if position < length else guessed[position - length])
            return guessed, n
        return [], 0

    def guess(self, count: int) -> tuple[list[int], list[float]]:
        """`find`'s tokens and the log-score of each chain prefix: the sum of its tokens' log-accuracies."""
        guessed, match = self.find(count)
        if not guessed:
            return [], []
        first, later = math.log(FIRST_TOKEN_ACCURACY[match]), math.log(NEXT_TOKEN_ACCURACY[match])
        return guessed, [first + offset * later for offset in range(count)]
