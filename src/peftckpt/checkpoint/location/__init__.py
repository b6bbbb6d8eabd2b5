"""Where checkpoints live: one :class:`~.base.Location` class with two implementations (a directory, a prefix on
an object store), the commit protocol written once against it (:mod:`.protocol`), and :func:`.urls.locate`, the
only place that tells a path from a URL."""
