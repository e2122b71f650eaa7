from relay.entry import main

raise SystemExit(main())
