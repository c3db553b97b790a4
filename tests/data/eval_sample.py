"""A hand-made file for the hole-cutting tests: which function bodies are block holes is known."""

import os


def two(a, b):
    c = a + b
    return c


def one():
    return 1


def nine(x):
    x += 1
    x += 2
    x += 3
    x += 4
    x += 5
    x += 6
    x += 7
    x += 8
    return x


class Box:
    def method(self, y):  # trailing comment on the header
        if y:
            return os.path.join(y, "a")
        return None

    async def later(self):
        await self.method(1)
        return 2


def single(a):
    return a * 2


def wrapped(
    first,
    second,
):
    total = first + second
    return total
