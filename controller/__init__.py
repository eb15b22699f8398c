"""Everything that runs on the laptop (``rgt``). May import ``onbox``; never the reverse."""
