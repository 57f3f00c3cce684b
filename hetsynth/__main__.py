from hetsynth.cli import main

raise SystemExit(main())
