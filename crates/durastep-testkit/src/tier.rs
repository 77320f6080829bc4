//! Test tiers and replayable randomness.
//!
//! Fault suites run a CI tier by default and a bigger soak tier when
//! `DURASTEP_SOAK=1` is set ([`soak`], [`scaled`]). A randomized test takes its
//! seed from `DURASTEP_SEED` when set (to replay a failure), else from the
//! clock, and prints it ([`seed`]); [`Rng`] is a small deterministic generator
//! (SplitMix64) so that the same seed gives the same fault schedule.

/// Set to `1` to run the soak tier (bigger counts) of the fault suites.
pub const SOAK_ENV: &str = "DURASTEP_SOAK";
/// Set to a number to replay a randomized test with that seed.
pub const SEED_ENV: &str = "DURASTEP_SEED";

/// Whether the soak tier was asked for (`DURASTEP_SOAK=1`).
///
/// ```
/// let _ = durastep_testkit::tier::soak();
/// ```
pub fn soak() -> bool {
    std::env::var(SOAK_ENV).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// `ci` in the CI tier, `soak` in the soak tier.
///
/// ```
/// let runs = durastep_testkit::tier::scaled(1_000, 10_000);
/// assert!(runs == 1_000 || runs == 10_000);
/// ```
pub fn scaled<T>(ci: T, soak: T) -> T {
    if self::soak() { soak } else { ci }
}

/// The seed of a randomized test: `DURASTEP_SEED` if set, else one from the
/// clock. Prints `"<test>: seed <n> (replay with DURASTEP_SEED=<n>)"` to stderr.
///
/// ```
/// let seed = durastep_testkit::tier::seed("doc");
/// let mut rng = durastep_testkit::tier::Rng::new(seed);
/// # let _ = rng.next_u64();
/// ```
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var(SEED_ENV).ok().and_then(|s| s.trim().parse().ok()).unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        (now.as_nanos() as u64) ^ u64::from(std::process::id()).rotate_left(32)
    });
    eprintln!("{test}: seed {seed} (replay with {SEED_ENV}={seed})");
    seed
}

/// A small deterministic random generator (SplitMix64): the same seed gives
/// the same sequence.
///
/// ```
/// use durastep_testkit::tier::Rng;
/// let (mut a, mut b) = (Rng::new(7), Rng::new(7));
/// assert_eq!(a.next_u64(), b.next_u64());
/// let x = a.range(500, 3_000);
/// assert!((500..3_000).contains(&x));
/// ```
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    ///
    /// ```
    /// let _ = durastep_testkit::tier::Rng::new(1);
    /// ```
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    ///
    /// ```
    /// let _ = durastep_testkit::tier::Rng::new(1).next_u64();
    /// ```
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `lo..hi` (`lo` when the range is empty).
    ///
    /// ```
    /// assert_eq!(durastep_testkit::tier::Rng::new(3).range(5, 6), 5);
    /// ```
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo { lo } else { lo + self.next_u64() % (hi - lo) }
    }
}
