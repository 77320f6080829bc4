"""Prints the engine's group-commit statement for a batch of checkpoints only,
with plain inserts and FOR NO KEY UPDATE SKIP LOCKED, as
`flush_statement(LockWait::Skip, false, Conflicts::Fail)` fills the macro
`flush_sql!` in crates/durastep/src/store/attempt.rs (cut out of the Rust
source). Its parameters stay `$1`..`$12`. Run from the repository root; used
by plans.sh and fence_cost.sh."""
import re

src = open("crates/durastep/src/store/attempt.rs").read()
body = re.search(r"macro_rules! flush_sql \{.*?concat!\(\s*(.*?)\n\s*\)\n\s*\};", src, re.S).group(1)
fin = re.search(r'macro_rules! fin_none \{.*?"(.*?)"', src, re.S).group(1)
fin_history = re.search(r'macro_rules! fin_none_history \{.*?"(.*?)"', src, re.S).group(1)
plain = re.search(r'macro_rules! plain_inserts \{(.*?)\n\}', src, re.S).group(1)
inserts = dict(re.findall(r'\((\w+)\) => \{\s*"(.*?)"', plain, re.S))
# The macro's arguments as the checkpoint-only flush of plain inserts fills them.
fill = {"lock": "FOR NO KEY UPDATE SKIP LOCKED", "fin": fin, "fin_history": fin_history}


def piece(m):
    text, name, inner = m.groups()
    if name is None:
        return text
    return inserts[inner] if name == "inserts" else fill[name]


print("".join(piece(m) for m in re.finditer(r'"((?:[^"\\]|\\.)*)"|\$(\w+)(?:!\((\w*)\))?', body)))
