-- The shadow week compares timing as well as amounts: when the request came,
-- when the shadow function would have written (after the platform's daily
-- reset, for TikTok), and when the old writer's write landed at the platform.
ALTER TABLE media.shadow_comparisons
    ADD COLUMN requested_at        timestamptz,
    ADD COLUMN planned_at          timestamptz,
    ADD COLUMN platform_written_at timestamptz;
