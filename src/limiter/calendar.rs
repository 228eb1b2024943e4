//! Calendar periods: a limit counted per day, week (Monday to Sunday),
//! month or year of a time zone's calendar, daylight saving included, so a
//! monthly budget resets when the month starts where its owner lives and
//! not 30 days after its first request.
//!
//! A period is an aligned window whose length changes (a month has 28 to
//! 31 days, a day 23 to 25 hours). The counters keep their window
//! arithmetic: the decision passes the counter its own clock, in ticks of
//! [`Period::tick_ms`], as `index × W + elapsed` where `index` numbers the
//! period (its civil date), `W` is the period's length in ticks and
//! `elapsed` the ticks since it began; `now / W` is then the period's index
//! and `now mod W` the time into it, exactly as for a fixed-length window.
//! The clock that places a period's edges is the deciding instance's
//! (`Engine`'s), so a test can move it; the time zone database is the one
//! compiled into the binary, so every instance places the edges alike.

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use jiff::{Timestamp, ToSpan, civil::Date, tz::TimeZone};
use serde::{Deserialize, Serialize};

/// A calendar period (`period:` of a limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Period {
    /// From midnight to midnight.
    Day,
    /// From Monday's midnight to the next Monday's (ISO 8601 weeks).
    Week,
    /// From the first of the month's midnight to the next month's.
    Month,
    /// From January 1st's midnight to the next year's.
    Year,
}

impl Period {
    /// Every period.
    pub const ALL: [Period; 4] = [Period::Day, Period::Week, Period::Month, Period::Year];

    /// The name in rule files.
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
            Period::Year => "year",
        }
    }

    /// The tick its counters count time in: a second for a day, a minute
    /// for a week or a month, an hour for a year. Coarser ticks for longer
    /// periods keep `capacity × W` within the counters' exact bound for
    /// budgets of billions (money in micro-units); a wait is rounded up to
    /// a tick, and the period's end is exact to the ms.
    pub fn tick_ms(self) -> u64 {
        match self {
            Period::Day => 1_000,
            Period::Week | Period::Month => 60_000,
            Period::Year => 3_600_000,
        }
    }

    /// The longest the period lasts, in ticks: its longest civil length and
    /// three hours more (a daylight-saving or offset change; two hours is
    /// the largest the time zone database records). A limit's capacity
    /// times this is what the counters' bound is checked against.
    pub fn max_ticks(self) -> u64 {
        const HOUR_MS: u64 = 3_600_000;
        let hours = match self {
            Period::Day => 24,
            Period::Week => 7 * 24,
            Period::Month => 31 * 24,
            Period::Year => 366 * 24,
        };
        (hours + 3) * HOUR_MS / self.tick_ms()
    }

    /// The first day of the period that contains `date`.
    fn first_day(self, date: Date) -> Date {
        match self {
            Period::Day => date,
            Period::Week => {
                date.checked_sub(i64::from(date.weekday().to_monday_zero_offset()).days()).unwrap_or(date)
            }
            Period::Month => date.first_of_month(),
            Period::Year => date.first_of_year(),
        }
    }

    /// The first day of the period after the one that starts on `first`.
    fn next(self, first: Date) -> Option<Date> {
        let span = match self {
            Period::Day => 1.day(),
            Period::Week => 1.week(),
            Period::Month => 1.month(),
            Period::Year => 1.year(),
        };
        first.checked_add(span).ok()
    }

    /// The period's number: days since 1970-01-01, weeks since the Monday
    /// before it, months since year 0, or the year; never negative for a
    /// period that starts after 1969.
    fn index(self, first: Date) -> u64 {
        let days = first.since(Date::constant(1970, 1, 1)).map_or(0, |span| i64::from(span.get_days()));
        let index = match self {
            Period::Day => days,
            // 1970-01-01 was a Thursday: its week began three days before.
            Period::Week => (days + 3).div_euclid(7),
            Period::Month => i64::from(first.year()) * 12 + i64::from(first.month()) - 1,
            Period::Year => i64::from(first.year()),
        };
        u64::try_from(index).unwrap_or(0)
    }
}

/// One period as it falls in a time zone: its number and where it starts
/// and ends, in Unix ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeriodAt {
    /// The period's number ([`Period`]'s index): the counter's window.
    pub index: u64,
    /// Its first ms.
    pub start_ms: u64,
    /// The first ms of the next period.
    pub end_ms: u64,
}

/// A counter's clock for one decision in a calendar period: what the store
/// counts with instead of its own clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ItemClock {
    /// Now, in ticks: the period's index × its length in ticks + the ticks
    /// elapsed in it.
    pub now: u64,
    /// ms from now to the period's end: a wait that ends with the period
    /// is answered to the ms.
    pub to_end_ms: u64,
}

impl ItemClock {
    /// `ticks` (a wait or a reset the arithmetic answered, from now) in
    /// ms, with `window` ticks per period of `tick_ms` each: exact at the
    /// period's end and whatever follows it whole, rounded up to a tick
    /// within it (never a wait that ends too early).
    pub fn ms(&self, ticks: u64, window: u64, tick_ms: u64) -> u64 {
        let to_end = window - self.now % window.max(1);
        match ticks.checked_sub(to_end) {
            Some(beyond) => self.to_end_ms.saturating_add(beyond.saturating_mul(tick_ms)),
            None => ticks.saturating_mul(tick_ms),
        }
    }
}

/// A period in a time zone (`period:` and `time_zone:` of a limit).
#[derive(Debug)]
pub struct Calendar {
    period: Period,
    zone: TimeZone,
    /// The zone's name as written.
    zone_name: Arc<str>,
    /// The period last asked for: most decisions fall in it.
    last: ArcSwapOption<PeriodAt>,
}

impl PartialEq for Calendar {
    fn eq(&self, other: &Self) -> bool {
        self.period == other.period && self.zone_name == other.zone_name
    }
}

impl Calendar {
    /// `period` in the time zone named `zone` (an IANA name such as
    /// `Europe/Berlin`, or `UTC`); an unknown name is an error naming it.
    pub fn new(period: Period, zone: &str) -> Result<Self, String> {
        let tz = TimeZone::get(zone).map_err(|e| format!("unknown time zone {zone:?}: {e}"))?;
        Ok(Calendar { period, zone: tz, zone_name: Arc::from(zone), last: ArcSwapOption::empty() })
    }

    /// The period.
    pub fn period(&self) -> Period {
        self.period
    }

    /// The time zone's name, as written.
    pub fn zone_name(&self) -> &str {
        &self.zone_name
    }

    /// The period that contains `now_ms` (Unix ms).
    pub fn at(&self, now_ms: u64) -> PeriodAt {
        if let Some(last) = self.last.load().as_deref()
            && (last.start_ms..last.end_ms).contains(&now_ms)
        {
            return *last;
        }
        let at = self.compute(now_ms);
        self.last.store(Some(Arc::new(at)));
        at
    }

    /// The counter's clock and its window in ticks, for a decision at `now_ms`.
    pub fn clock(&self, now_ms: u64) -> (ItemClock, u64) {
        let at = self.at(now_ms);
        let tick = self.period.tick_ms();
        let window = (at.end_ms - at.start_ms).div_ceil(tick).max(1);
        let elapsed = (now_ms - at.start_ms) / tick;
        let now = at.index.saturating_mul(window).saturating_add(elapsed);
        (ItemClock { now, to_end_ms: at.end_ms - now_ms }, window)
    }

    fn compute(&self, now_ms: u64) -> PeriodAt {
        let millis = i64::try_from(now_ms).unwrap_or(i64::MAX);
        let at = Timestamp::from_millisecond(millis).unwrap_or(Timestamp::MAX);
        let first = self.period.first_day(at.to_zoned_datetime(self.zone.clone()).date());
        let start = self.midnight(first).unwrap_or(now_ms).min(now_ms);
        let end = self.period.next(first).and_then(|next| self.midnight(next)).unwrap_or(u64::MAX);
        PeriodAt { index: self.period.index(first), start_ms: start, end_ms: end.max(now_ms + 1) }
    }

    /// The first instant of `date` in the zone (its midnight, or the end of
    /// a daylight-saving gap that swallows midnight), in Unix ms.
    fn midnight(&self, date: Date) -> Option<u64> {
        let day = date.to_zoned_datetime(self.zone.clone()).ok()?.start_of_day().ok()?;
        u64::try_from(day.timestamp().as_millisecond()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(text: &str) -> u64 {
        u64::try_from(text.parse::<Timestamp>().unwrap().as_millisecond()).unwrap()
    }

    fn berlin(period: Period) -> Calendar {
        Calendar::new(period, "Europe/Berlin").unwrap()
    }

    #[test]
    fn a_month_runs_from_the_first_to_the_first_in_its_zone() {
        let month = berlin(Period::Month);
        // October 2026 in Berlin: from CEST (+02:00) into CET (+01:00), 31 days and an hour.
        let at = month.at(ms("2026-10-15T12:00:00Z"));
        assert_eq!(at.start_ms, ms("2026-09-30T22:00:00Z"));
        assert_eq!(at.end_ms, ms("2026-10-31T23:00:00Z"));
        assert_eq!(at.end_ms - at.start_ms, (31 * 24 + 1) * 3_600_000);
        assert_eq!(at.index, 2026 * 12 + 9);
        // The month's last ms and the next month's first.
        assert_eq!(month.at(ms("2026-10-31T22:59:59.999Z")).index, at.index);
        let november = month.at(ms("2026-10-31T23:00:00Z"));
        assert_eq!((november.index, november.start_ms), (at.index + 1, at.end_ms));
        // February: 28 days, and 29 in a leap year.
        let february = month.at(ms("2027-02-10T00:00:00Z"));
        assert_eq!(february.end_ms - february.start_ms, 28 * 86_400_000);
        let leap = month.at(ms("2028-02-10T00:00:00Z"));
        assert_eq!(leap.end_ms - leap.start_ms, 29 * 86_400_000);
        // New York's month is five or six hours behind UTC's.
        let new_york = Calendar::new(Period::Month, "America/New_York").unwrap();
        assert_eq!(new_york.at(ms("2026-11-01T03:00:00Z")).index, 2026 * 12 + 9);
        assert_eq!(new_york.at(ms("2026-11-01T04:00:00Z")).index, 2026 * 12 + 10);
    }

    #[test]
    fn days_weeks_and_years_follow_daylight_saving() {
        let day = berlin(Period::Day);
        // 2026-03-29: clocks go from 02:00 to 03:00, a day of 23 hours.
        let spring = day.at(ms("2026-03-29T10:00:00Z"));
        assert_eq!(spring.end_ms - spring.start_ms, 23 * 3_600_000);
        let autumn = day.at(ms("2026-10-25T10:00:00Z"));
        assert_eq!(autumn.end_ms - autumn.start_ms, 25 * 3_600_000);
        assert_eq!(autumn.index + 1, day.at(autumn.end_ms).index);
        // A week from Monday: 2026-11-25 is a Wednesday.
        let week = berlin(Period::Week).at(ms("2026-11-25T12:00:00Z"));
        assert_eq!(week.start_ms, ms("2026-11-22T23:00:00Z"));
        assert_eq!(week.end_ms - week.start_ms, 7 * 86_400_000);
        let year = berlin(Period::Year).at(ms("2026-06-01T00:00:00Z"));
        assert_eq!((year.index, year.start_ms), (2026, ms("2025-12-31T23:00:00Z")));
        // Santiago moves its clocks at midnight: 2024-09-08 starts at 01:00.
        let santiago = Calendar::new(Period::Day, "America/Santiago").unwrap();
        let gap = santiago.at(ms("2024-09-08T12:00:00Z"));
        assert_eq!(gap.start_ms, ms("2024-09-08T04:00:00Z"));
        assert_eq!(gap.end_ms - gap.start_ms, 23 * 3_600_000);
    }

    #[test]
    fn the_clock_places_now_in_its_period() {
        for period in Period::ALL {
            for zone in ["UTC", "Europe/Berlin", "Australia/Lord_Howe", "Pacific/Apia", "America/Santiago"] {
                let calendar = Calendar::new(period, zone).unwrap();
                let mut now = ms("2011-01-01T00:00:00Z");
                while now < ms("2029-01-01T00:00:00Z") {
                    let at = calendar.at(now);
                    let (clock, window) = calendar.clock(now);
                    assert!(window <= period.max_ticks(), "{period:?} {zone} {at:?}");
                    assert_eq!(clock.now / window, at.index, "{period:?} {zone}");
                    assert_eq!(clock.to_end_ms, at.end_ms - now);
                    // The end is exact; a wait within the period rounds up.
                    let to_end = window - clock.now % window;
                    assert_eq!(clock.ms(to_end, window, period.tick_ms()), at.end_ms - now);
                    assert!(clock.ms(1, window, period.tick_ms()) >= 1);
                    now += 7 * 3_600_000 + 13 * 60_000 + 17_001;
                }
            }
        }
    }

    #[test]
    fn an_unknown_zone_is_named() {
        let error = Calendar::new(Period::Month, "Mars/Olympus").unwrap_err();
        assert!(error.contains("Mars/Olympus"), "{error}");
    }
}
