//! The guide's user-facing snippets use the public API: `durastep::testing`
//! exists only with the `testing` feature, so outside the testing chapter a
//! snippet using it would not compile in a user's application.

/// Catches: a snippet outside chapter 14 ("Testing your workflows") that
/// calls `durastep::testing::...` (chapters 11 and 17 took the database
/// clock from `durastep::testing::db_now` instead of `Inspector::db_now`).
#[test]
fn only_the_testing_chapter_uses_the_testing_feature() {
    let guide = include_str!("../../../docs/guide.md");
    let mut chapter = String::new();
    let mut offenders = Vec::new();
    for (n, line) in guide.lines().enumerate() {
        if let Some(title) = line.strip_prefix("## ") {
            chapter = title.to_owned();
        }
        if line.contains("durastep::testing::") && !chapter.starts_with("14. ") {
            offenders.push(format!("line {} ({chapter}): {line}", n + 1));
        }
    }
    assert!(offenders.is_empty(), "use the public API (engine.inspect().db_now()) instead: {offenders:#?}");
}
