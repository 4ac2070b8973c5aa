//! What the sweep may delete and why: the deletion gate every DELETE passes (`gate`), the
//! licence without which no sweep runs (`licence`), the listing of every page and the selection
//! from it (`listing`), and what it spares of other slots and young registrations (`spare`).
//! The paging and the DELETEs themselves are `driver::sweep`'s.

pub mod gate;
pub mod licence;
pub mod listing;
pub mod spare;
