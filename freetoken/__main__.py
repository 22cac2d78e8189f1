from freetoken.cli import main

raise SystemExit(main())
