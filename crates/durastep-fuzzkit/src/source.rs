//! Where the generators get their choices: a seeded PRNG (the CI smoke test)
//! or the fuzzer's input bytes (the cargo-fuzz targets).

/// A stream of choices. From bytes it is finite: once they run out every
/// choice is 0, and the generators are written so that 0 means "stop, small,
/// close": generation always ends, and short fuzzer inputs give small cases.
///
/// ```
/// use durastep_fuzzkit::Source;
/// let mut a = Source::seeded(42);
/// let mut b = Source::seeded(42);
/// assert_eq!(a.below(1000), b.below(1000));
/// let mut f = Source::from_bytes(&[3]);
/// assert_eq!(f.below(10), 3);
/// assert_eq!(f.below(10), 0); // exhausted
/// assert!(f.is_exhausted());
/// ```
#[derive(Debug, Clone)]
pub struct Source<'a> {
    bytes: &'a [u8],
    /// Some(state) for a seeded source (splitmix64), None for bytes.
    state: Option<u64>,
}

impl Source<'static> {
    /// An endless source seeded with `seed` (splitmix64: no dependency, same
    /// sequence on every platform).
    pub fn seeded(seed: u64) -> Self {
        Source { bytes: &[], state: Some(seed) }
    }
}

impl<'a> Source<'a> {
    /// A source that reads its choices from `bytes` (a fuzzer input).
    pub fn from_bytes(bytes: &'a [u8]) -> Self {
        Source { bytes, state: None }
    }

    /// The bytes not read yet (none for a seeded source): a fuzz target's
    /// raw text, after the choices it read first.
    ///
    /// ```
    /// let mut src = durastep_fuzzkit::Source::from_bytes(b"\x01abc");
    /// assert_eq!(src.below(2), 1);
    /// assert_eq!(src.rest(), b"abc");
    /// ```
    pub fn rest(self) -> &'a [u8] {
        self.bytes
    }

    /// Whether a byte source has run out (a seeded one never does).
    pub fn is_exhausted(&self) -> bool {
        self.state.is_none() && self.bytes.is_empty()
    }

    /// The next `n` (at most 8) bytes as a little-endian number; 0 once exhausted.
    fn take(&mut self, n: usize) -> u64 {
        if let Some(state) = &mut self.state {
            *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = *state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            return z ^ (z >> 31);
        }
        let n = n.min(self.bytes.len());
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        head.iter().rev().fold(0, |acc, b| (acc << 8) | u64::from(*b))
    }

    /// Any 64-bit number.
    pub fn u64(&mut self) -> u64 {
        self.take(8)
    }

    /// A number in `0..n` (0 when `n` is 0). From bytes it reads only as many
    /// bytes as `n` needs, so the fuzzer's mutations map to choices closely.
    pub fn below(&mut self, n: u64) -> u64 {
        if n <= 1 {
            return 0;
        }
        let bytes = match n {
            0..=0x100 => 1,
            0x101..=0x1_0000 => 2,
            0x1_0001..=0x1_0000_0000 => 4,
            _ => 8,
        };
        self.take(bytes) % n
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below((hi - lo) as u64 + 1) as usize
    }

    /// True about one time in `n`; false from an exhausted byte source (for
    /// `n` > 1), so rare extras stop when the input runs out.
    pub fn one_in(&mut self, n: u64) -> bool {
        n > 0 && self.below(n) == n - 1
    }

    /// One of `items` (the first once exhausted).
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}
