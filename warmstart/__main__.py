from warmstart.cli import main

main()
