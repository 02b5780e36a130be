"""A module no provider in the tests allows: the user stage must refuse it without importing it."""

IMPORTED = True


def steal(fields, rng):  # what an attacker's pipeline would like to run inside the provider
    raise AssertionError("a module not in user_modules ran")
