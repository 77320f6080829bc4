"""Prints the engine's group-commit statement for a batch of checkpoints only,
with plain inserts and FOR NO KEY UPDATE SKIP LOCKED, as `flush_statement`
fills the macro `flush_sql!` in crates/durastep/src/store/attempt.rs for such
a batch (`flush_sql!("FOR NO KEY UPDATE SKIP LOCKED", checkpoints,
no_completions, plain_inserts)`), cut out of the Rust source. Its parameters
stay `$1`..`$12`. Run from the repository root; used by plans.sh and
fence_cost.sh."""
import re

src = open("crates/durastep/src/store/attempt.rs").read()


def arms(name):
    """The string arms `(part) => { "text" };` of `macro_rules! name`."""
    block = re.search(r"macro_rules! %s \{(.*?)\n\}" % name, src, re.S).group(1)
    return dict(re.findall(r'\((\w+)\) => \{\s*"((?:[^"\\]|\\.)*)"\s*\}', block, re.S))


body = re.search(r"macro_rules! flush_sql \{.*?concat!\(\s*(.*?)\n\s*\)\n\s*\};", src, re.S).group(1)
# The macro's arguments as a checkpoint-only flush of plain inserts fills them:
# the completions' parts (`no_completions!`) are all empty.
fill = {"cps": arms("checkpoints"), "inserts": arms("plain_inserts"), "dns": {}}
lock = "FOR NO KEY UPDATE SKIP LOCKED"


def piece(m):
    text, name, part = m.groups()
    if text is not None:
        return text
    if name == "lock":
        return lock
    return fill[name].get(part, "")


print("".join(piece(m) for m in re.finditer(r'"((?:[^"\\]|\\.)*)"|\$(\w+)(?:!\((\w*)[^)]*\))?', body)))
